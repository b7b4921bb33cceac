"""A resource that joins another lab's swarm (`spec.join`): the lab runs only what it
contributes (a Swarm's trainers, auxiliaries and backbone peers; a BlockServer's servers; an
ExpertPool's expert servers and trainers), and takes what the swarm computes from the host
through its token service.

Each kind names its lab-owned fields (how many peers, on what hardware, where, how reachable);
every other field is the host's. A joining resource that sets a host-owned field is refused,
with the field named: by the model (`check_join`, for `hivekeeper validate` and the operator)
and by the API server at apply (`host_owned_rules`, CEL). The API server stores every default
before its rules run, so CEL cannot tell a field left out from one written with its default:
the rules test each host-owned field against the default, leaf by leaf, as the model does."""

from __future__ import annotations

import json
from typing import Any, Sequence

from pydantic import BaseModel, Field

from hivekeeper.spec.base import CelRule, SpecModel
from hivekeeper.spec.placement import DNS_SUBDOMAIN

# host:port, the host a DNS name or an IPv4 address (an IPv6 one in brackets)
GATEWAY_PATTERN = r"^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$"
INVITE_KEY = "invite"  # the key of spec.join.inviteSecret that holds the invite
HOST_OWNED = "takes this from the host (spec.join); remove it"  # the refusal of a host-owned field
JOIN_DESCRIPTION = ("join another lab's swarm instead of hosting one: run only this lab's peers, and take the "
                    "task, model and averaging from the host's token service")


class JoinSpec(SpecModel):
    """Where the host lab's swarm admits this lab, and with which invite."""

    gateway: str = Field(..., pattern=GATEWAY_PATTERN, max_length=260,
                         description="the host's token service, host:port (its volunteers' gateway)")
    invite_secret: str = Field(..., pattern=DNS_SUBDOMAIN, max_length=253,
                               description=f"a Secret in this namespace whose key '{INVITE_KEY}' holds the invite "
                                           f"the host minted for this lab (hivekeeper invite --lab)")


def host_owned_paths(model: type[BaseModel], lab_owned: Sequence[str]) -> list[str]:
    """The camelCase paths of `model` that are the host's: every top-level field but those in
    `lab_owned`, and inside a group some of whose fields are lab-owned (`trainers.replicas`),
    the group's other fields."""
    return _host_owned(model, tuple(lab_owned), "")


def _host_owned(model: type[BaseModel], lab_owned: tuple[str, ...], prefix: str) -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        if path in lab_owned:
            continue
        inner = [owned for owned in lab_owned if owned.startswith(f"{path}.")]
        if inner:
            sub = info.annotation
            if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
                raise TypeError(f"{path}: only a model's fields can be split between host and lab")
            paths += _host_owned(sub, lab_owned, f"{path}.")
        else:
            paths.append(path)
    return paths


def check_join(spec: BaseModel, lab_owned: Sequence[str], kind: str) -> None:
    """Raises ValueError naming the host-owned fields a joining `spec` sets away from their
    defaults (a rendered manifest that states every default is not an error). Call it at the
    end of the kind's validator, once the spec is normalized as its default is."""
    if getattr(spec, "join", None) is None:
        return
    default = type(spec)().model_dump(by_alias=True, mode="json")
    given = spec.model_dump(by_alias=True, mode="json")
    changed = [path for owned in host_owned_paths(type(spec), lab_owned)
               for path in _differences(_at(given, owned), _at(default, owned), owned)]
    if changed:
        raise ValueError(f"{', '.join(changed)}: a joining {kind} {HOST_OWNED}")


def _at(document: Any, path: str) -> Any:
    for part in path.split("."):
        document = document.get(part) if isinstance(document, dict) else None
    return document


def _differences(given: Any, default: Any, path: str) -> list[str]:
    """The leaf paths where `given` differs from `default` (None and empty count as unset)."""
    if isinstance(given, dict) and isinstance(default, dict) and given and default:
        return [found for key in sorted(set(given) | set(default))
                for found in _differences(given.get(key), default.get(key), f"{path}.{key}")]
    return [] if _unset(given) and _unset(default) or given == default else [path]


def _unset(value: Any) -> bool:
    return value is None or value == {} or value == []


def host_owned_rules(model: type[BaseModel], lab_owned: Sequence[str], kind: str,
                     schema: dict[str, Any]) -> tuple[CelRule, ...]:
    """One CEL rule per host-owned field of `model`: with spec.join set, it holds only its
    default. `schema` is the kind's structural spec schema (each leaf's CEL type)."""
    default = model().model_dump(by_alias=True, mode="json", exclude_none=True)
    rules = []
    for path in host_owned_paths(model, lab_owned):
        node = schema
        for part in path.split("."):
            node = node["properties"][part]
        rules.append(CelRule(f"!has(self.join) || {is_default(f'self.{path}', _at(default, path), node)}",
                             f"a joining {kind} {HOST_OWNED}", f".{path}"))
    return tuple(rules)


def is_default(expr: str, default: Any, node: dict[str, Any]) -> str:
    """CEL that holds when the field at `expr` (a field selection, its parent present) is absent
    or holds `default`, its stored default (None: none)."""
    if node.get("x-kubernetes-preserve-unknown-fields"):  # free-form: CEL sees an object without fields
        if default not in (None, {}):
            raise TypeError(f"{expr}: a free-form field's default must be empty")
        return f"!has({expr})"
    if "additionalProperties" in node or node.get("type") == "array":
        if default in (None, {}, []):
            return f"(!has({expr}) || size({expr}) == 0)"
        return f"(!has({expr}) || {expr} == {_literal(default, node)})"
    if node.get("type") == "object":
        if default is None:
            return f"!has({expr})"
        parts = [is_default(f"{expr}.{name}", default.get(name), sub) for name, sub in node["properties"].items()]
        return f"(!has({expr}) || ({' && '.join(parts)}))"
    if default is None:
        return f"!has({expr})"
    if node.get("x-kubernetes-int-or-string"):  # 2 and "2" are the same quantity
        return f"(!has({expr}) || string({expr}) == {_literal(str(default), {'type': 'string'})})"
    return f"(!has({expr}) || {expr} == {_literal(default, node)})"


def _literal(value: Any, node: dict[str, Any]) -> str:
    """`value` as a CEL literal of the schema node's type (a `number` is a double: 2.0)."""
    if isinstance(value, list):
        item = node.get("items", {})
        return "[" + ", ".join(_literal(v, item) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if node.get("type") == "number":
        return repr(float(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # CEL's double-quoted strings take JSON's escapes
    raise TypeError(f"no CEL literal for {value!r}")
