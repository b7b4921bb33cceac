"""Input files of `hivekeeper plan ...` (JSON read exactly as YAML reads it) and the command
line's start (a command imports its own modules only; `--help` still lists every command)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml
from pydantic import RootModel

from hivekeeper.cli import COMMANDS, main
from hivekeeper.errors import UserError
from hivekeeper.inputs import load_input


class Anything(RootModel[Any]):
    pass


DOCUMENTS = [
    '{"peers": [{"name": "a", "samplesPerSecond": 1.5, "clientMode": true}], "links": {}, "x": null}',
    '{"a": -0.0, "b": 2.5e-07, "c": 1.0E+400, "d": 0, "e": -12, "f": "x: {y} # z", "g": [], "h": "<<"}',
    '{"a":1,"b":[1,2.25],"a":3}',  # no spaces; a duplicate key: the last wins in both
    '{"a": 1e5, "b": 1.5e5, "c": 1E+5}',  # YAML 1.1 reads these as strings
    '{"a": NaN, "b": Infinity, "c": -Infinity}',  # the json module's extension; strings to YAML
    '{"a": "caf\\u00e9 \\/ \\"q\\" \\ud83d\\ude00"}',  # escapes
    '{"a": "café"}',
    '{"a":\t1}',  # a tab between tokens
    '[1, {"x": [2, 3.25]}]',
    '"x"',
    "5",
    "null",
    "a: 1\nb: [1, 2.5]\n",  # YAML proper
    '{"a": 1,\n "b": [1,\n 2]\n}\n',
    '{"a"\n: 1}',  # JSON that YAML refuses: a key and its colon on two lines
    json.dumps({"p" * 1100: 1}),  # ... a key over 1,024 characters
    '{"a": 1',  # neither
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_an_input_file_reads_as_yaml_reads_it_or_else_as_json(tmp_path, text):
    path = tmp_path / "input.json"
    path.write_text(text, encoding="utf-8")
    try:
        expected = repr(yaml.load(text, Loader=yaml.CSafeLoader))  # repr: nan == nan, True != 1, -0.0 != 0.0
    except yaml.YAMLError:
        try:
            expected = repr(json.loads(text))
        except ValueError:
            with pytest.raises(UserError, match="not valid YAML or JSON"):
                load_input(str(path), Anything)
            return
    assert repr(load_input(str(path), Anything).root) == expected


def test_plan_averaging_imports_neither_the_roles_nor_the_manifest_models(tmp_path):
    """`hivekeeper run`'s roles and the spec models took about half of the command's start-up."""
    path = tmp_path / "peers.json"
    path.write_text(json.dumps({"targetBatchSize": 512, "numParameters": 1000, "peers": [
        {"name": "a", "samplesPerSecond": 10, "uploadMbps": 100, "downloadMbps": 100},
        {"name": "b", "samplesPerSecond": 0, "uploadMbps": 50, "downloadMbps": 200}]}))
    script = ("import sys; from hivekeeper.cli import main; code = main(sys.argv[1:]); "
              "print(*sorted(sys.modules), file=sys.stderr); sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", script, "plan", "averaging", "--input", str(path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["peers"][0]["name"] == "a"
    modules = set(out.stderr.split())
    assert "hivekeeper.commands.plan" in modules
    assert not modules & {"hivekeeper.commands.run", "hivekeeper.kinds", "hivekeeper.spec", "torch", "hivemind",
                          "rich", "yaml"}


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    listed = re.findall(r"^    (\w+)", capsys.readouterr().out, re.M)
    assert listed == list(COMMANDS)
