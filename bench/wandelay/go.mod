module hivekeeper.dev/bench/wandelay

go 1.22
