"""Manifest validation: good examples load; bad ones fail before anything starts, with one line
naming the field path, and exit code 2."""

from __future__ import annotations

import pytest

from conftest import EXAMPLES, write_manifest
from hivekeeper.cli import main
from hivekeeper.spec import load_manifest, parse_manifest
from hivekeeper.spec.swarm import SwarmSpec


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("swarm-*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path):
    manifest = load_manifest(path)
    assert isinstance(manifest.spec, SwarmSpec)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_the_rendered_manifest_every_role_reads_parses_to_the_same(path):
    """Roles read the manifest as `hivekeeper up` and the operator render it: every default
    stated. Reading it back must give the same spec (a validator that treats a stated default
    as a user's choice would stop every role)."""
    manifest = load_manifest(path)
    rendered = manifest.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert parse_manifest(rendered).spec == manifest.spec


def test_defaults_make_a_short_manifest_work(tmp_path):
    path = tmp_path / "short.yaml"
    path.write_text("apiVersion: hivekeeper.dev/v1alpha1\nkind: Swarm\nmetadata: {name: tiny}\nspec: {}\n")
    spec = load_manifest(path).spec
    assert spec.trainers.replicas >= 1 and spec.target_batch_size > 0 and spec.stopping.target_steps


BAD = [
    ({"kind": "Swarn"}, "kind: expected one of"),
    ({"apiVersion": "hivekeeper.dev/v2"}, "apiVersion: expected 'hivekeeper.dev/v1alpha1'"),
    ({"spec": {"trainers": {"replicaz": 3}}}, "spec.trainers.replicaz: unknown field"),
    ({"spec": {"trainers": {"replicas": -1}}}, "spec.trainers.replicas: Input should be greater than or equal to 0"),
    ({"spec": {"targetBatchSize": "lots"}}, "spec.targetBatchSize: Input should be a valid integer"),
    ({"spec": {"trainers": {"batchSize": 512}, "targetBatchSize": 256}}, "exceeds targetBatchSize"),
    ({"spec": {"averaging": {"targetGroupSize": 9}}}, "averaging.targetGroupSize (9) exceeds the averaging peers"),
    ({"spec": {"averaging": {"compression": "zip"}}}, "spec.averaging.compression: Input should be"),
    ({"spec": {"task": {"name": "imagenet"}}}, "spec.task.name: expected one of causal-lm, digits"),
    ({"spec": {"task": {"options": {"hiddenSise": 3}}}}, "spec.task.options.hiddenSise: unknown field"),
    ({"spec": {"stopping": {"targetSteps": None, "targetMetric": None}}}, "set targetSteps and/or targetMetric"),
    ({"metadata": {"name": "Digits_1"}}, "metadata.name: must be lowercase"),
    ({"spec": {"averaging": {"mode": "merge"}}}, "spec.averaging.mode: Input should be 'gradients', 'parameters', 'ties' or 'diloco'"),
    ({"spec": {"averaging": {"mergeEverySteps": 5}}}, "mergeEverySteps: only for mode parameters or ties"),
    ({"spec": {"averaging": {"mode": "parameters", "trim": 0.2}}}, "trim: only for mode ties"),
    ({"spec": {"averaging": {"mode": "ties", "mergeEverySteps": 5, "shiftEverySteps": 5}}},
     "shiftEverySteps (5) must be below mergeEverySteps (5)"),
    ({"spec": {"averaging": {"mode": "ties"}}}, "auxiliary.replicas: auxiliary peers help gradient averaging only"),
]


@pytest.mark.parametrize("changes,expected", BAD, ids=[expected for _, expected in BAD])
def test_bad_manifest_is_rejected_with_one_line(tmp_path, capsys, changes, expected):
    path = write_manifest(tmp_path, changes)
    run_dir = tmp_path / "run"
    code = main(["up", str(path), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists(), "nothing may be started or written for a bad manifest"


def test_unreadable_and_malformed_files(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Swarm\nspec: [unclosed\n")
    assert main(["validate", str(broken)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    two = tmp_path / "two.yaml"
    two.write_text((EXAMPLES / "swarm-digits.yaml").read_text() + "\n---\n" + (EXAMPLES / "swarm-digits.yaml").read_text())
    assert main(["validate", str(two)]) == 2
    assert "exactly one manifest" in capsys.readouterr().err
