"""The role layer every kind runs on (Swarm, BlockServer, ExpertPool alike): a role's command
line (`arguments`), its context (spec, DHT, HTTP endpoint, reports in the DHT: `context`), its
structured logs and signals (`lifecycle`), the backbone every kind bootstraps from
(`backbone`), and what training loops share (`loops`).

A kind is a package (`hivekeeper.swarm`, `.blocks`, `.experts`) whose `kind` module declares its
roles and how they run (`hivekeeper.kinds.KindRuntime`); nothing here knows any kind."""
