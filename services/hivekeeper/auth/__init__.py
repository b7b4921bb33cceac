"""Admission by token (DeDLOC appendix I.5): the swarm's signing key, invites and access tokens,
the token service (gateway) that trades an invite for a token, and the DHT authorizer that signs
and checks every request with it."""
