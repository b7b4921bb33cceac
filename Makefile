# The two commands of the README.
#   make demo   install into .venv, then run the main job: a Swarm trains a digit classifier
#   make test   install into .venv, then run the test suite
.PHONY: install demo test

install:
	./scripts/install.sh

demo: install
	.venv/bin/hivekeeper up examples/swarm-digits.yaml --run-dir runs/digits

test: install
	./scripts/test.sh
