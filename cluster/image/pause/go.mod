module hivekeeper.dev/cluster/pause

go 1.19
