"""The BlockServer kind (Petals): block servers, the balancer, the remote-sequence client,
and parameter-efficient fine-tuning through servers whose weights never change."""
