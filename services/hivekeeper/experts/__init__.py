"""The ExpertPool kind: Learning@home's decentralized mixture-of-experts on hivemind.moe."""
