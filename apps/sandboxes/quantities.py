"""Kubernetes-style quantities: cpu ("2", "0.5", "500m") and memory ("512Mi", "2Gi", "1G")."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_MEM = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|K|M|G|T|k)?$")
_MEM_FACTORS = {
    None: Decimal(1),
    "Ki": Decimal(1024),
    "Mi": Decimal(1024**2),
    "Gi": Decimal(1024**3),
    "Ti": Decimal(1024**4),
    "k": Decimal(1000),
    "K": Decimal(1000),
    "M": Decimal(1000**2),
    "G": Decimal(1000**3),
    "T": Decimal(1000**4),
}


class QuantityError(ValueError):
    pass


def parse_cpu_millis(value: object) -> int:
    """CPU as millicores. Numbers are cores; strings may end in ``m``."""
    if isinstance(value, bool):
        raise QuantityError("cpu must be a number of cores or a string like '500m'")
    if isinstance(value, (int, float)):
        text = repr(float(value)) if isinstance(value, float) else str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise QuantityError("cpu must be a number of cores or a string like '500m'")
    match = _CPU.match(text)
    if not match:
        raise QuantityError(f"invalid cpu quantity {value!r} (examples: 1, 0.5, '2', '500m')")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # pragma: no cover - regex guarantees digits
        raise QuantityError(f"invalid cpu quantity {value!r}") from exc
    millis = number if match.group(2) == "m" else number * 1000
    if millis != millis.to_integral_value() or millis <= 0:
        raise QuantityError(f"cpu must be a positive whole number of millicores, got {value!r}")
    return int(millis)


def parse_memory_mib(value: object) -> int:
    """Memory in MiB. Plain integers are MiB; strings take Ki/Mi/Gi/Ti or k/M/G/T suffixes."""
    if isinstance(value, bool):
        raise QuantityError("memory must be MiB as an integer or a string like '2Gi'")
    if isinstance(value, int):
        if value <= 0:
            raise QuantityError("memory must be positive")
        return value
    if not isinstance(value, str):
        raise QuantityError("memory must be MiB as an integer or a string like '2Gi'")
    match = _MEM.match(value.strip())
    if not match:
        raise QuantityError(f"invalid memory quantity {value!r} (examples: '512Mi', '2Gi')")
    suffix = match.group(2)
    number = Decimal(match.group(1))
    if suffix is None:
        # A bare string number is MiB, as for integers (not bytes: nobody means 512 bytes).
        total_bytes = number * Decimal(1024**2)
    else:
        total_bytes = number * _MEM_FACTORS[suffix]
    mib = total_bytes / Decimal(1024**2)
    if mib < 1:
        raise QuantityError(f"memory {value!r} is below 1Mi")
    return int(mib.to_integral_value(rounding="ROUND_CEILING"))
