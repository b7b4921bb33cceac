"""hivekeeper: decentralized deep-learning swarms (DeDLOC, Petals, Learning@home) on hivemind."""

__version__ = "0.3.0"
API_GROUP = "hivekeeper.dev"
API_VERSION = "v1alpha1"
