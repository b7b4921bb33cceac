# The two commands of the README.
#   make demo   install into .venv, then run the main job: a Swarm trains a digit classifier
#   make test   install into .venv, then run the test suite (the real-cluster tier last)
# And the real-cluster tier alone: make e2e (builds and starts a Kubernetes here, then removes it).
.PHONY: install demo test e2e

install:
	./scripts/install.sh

demo: install
	.venv/bin/hivekeeper up examples/swarm-digits.yaml --run-dir runs/digits

test: install
	./scripts/test.sh

e2e: install
	trap 'scripts/cluster.sh labs down' EXIT; scripts/cluster.sh labs up && ./scripts/test.sh -m e2e tests/e2e
