"""Kubernetes quantities (a pod's cpu and memory, a claim's size) as Kubernetes takes them: a
whole number or a string such as "500m", "1.5Gi" or "1e3". The CRD states the same as an
int-or-string with a pattern, so the API server refuses what `hivekeeper validate` refuses."""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

from pydantic import PlainValidator, WithJsonSchema

# Kubernetes' quantity grammar without a sign (requests are never negative): a decimal number,
# then a binary suffix (Ki..Ei), a decimal one (m, k, M..E) or an exponent.
QUANTITY = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?$"
_QUANTITY = re.compile(QUANTITY)


def _quantity(value: Any) -> Union[int, str]:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _QUANTITY.match(value):
        return value
    # A float is refused as the API server refuses it (int-or-string): 0.5 is written "500m" or "0.5".
    raise ValueError(f"expected a Kubernetes quantity: a whole number or a string such as '500m' or '1.5Gi' "
                     f"(got {value!r})")


Quantity = Annotated[
    Union[int, str],
    PlainValidator(_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY, "minimum": 0}),
]


_DECIMAL = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {f"{p}i": 1024 ** (i + 1) for i, p in enumerate("KMGTPE")}


def quantity_value(quantity: Union[int, str]) -> float:
    """A quantity's value: "500m" -> 0.5, "2Gi" -> 2147483648.0, 3 -> 3.0."""
    value = _quantity(quantity)
    if isinstance(value, int):
        return float(value)
    match = _QUANTITY.match(value)
    number, suffix = value[:match.start(3)] if match.group(3) else value, match.group(3) or ""
    if suffix in _BINARY:
        return float(number) * _BINARY[suffix]
    if suffix in _DECIMAL:
        return float(number) * _DECIMAL[suffix]
    return float(number + suffix)  # none, or an exponent such as 1e3
