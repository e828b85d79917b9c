"""The plan name: the text PlanPrepare.layout_name carries next to the structured Layout, typed.
Mirrors transport/plan_name.h (one encoder, one decoder); both replay tests/data/plan_name/.

Two kinds of text ride in that field, and the codec tells them apart by the first field, which
every reader reads the same way:

* "keep" or a one-letter key followed by '=' is a live action (launch's builtin agent):
  "s=0.75/0.25;c=2n1p27h;k=0.01;r=4;b=1048576;m=2;l=dp=1,pp=4";
* "dp" and a digit is a layout name (parapilot deploy): "dp8-tp2-pp1-mb1[-sp][-vV]-zZ[-elastic]"
  then ";sc=", ";rc=", ";st=16,16", ";sh=33*7,29", ";g=0-2,4-15,3";
* anything else without ';' or '=' is a label for logs ("", "scripted"), carrying nothing.

decode() raises PlanNameError (a ValueError) naming the field; encode() raises it for a name
that cannot be written. Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Union

from .wire import MAX_NAME_BYTES, MAX_RANKS, CompressionMethod

__all__ = ["PlanNameError", "LayoutPlanName", "ActionPlanName", "LabelPlanName", "PlanName",
           "kind", "encode", "decode"]

_MAX_COUNT = 1 << 20
_SCHEDULES = ("gpipe", "1f1b", "interleaved")
_RECOMPUTES = ("none", "selective", "full")
_CODES = {"n": CompressionMethod.NONE, "h": CompressionMethod.FP16, "t": CompressionMethod.TOPK,
          "p": CompressionMethod.POWERSGD}
_CODE_OF = {v: k for k, v in _CODES.items()}


class PlanNameError(ValueError):
    """A plan name that cannot be read or written; the message names the field."""


@dataclass
class LayoutPlanName:
    """A planner layout by name: what the wire Layout lacks (deploy's plans)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatch: int = 1
    sp: bool = False
    virtual_stages: int = 1
    zero: int = 0
    elastic: bool = False
    schedule: Optional[str] = None
    recompute: Optional[str] = None
    stage_layers: List[int] = field(default_factory=list)
    dp_shares: List[int] = field(default_factory=list)
    gpus: List[int] = field(default_factory=list)


@dataclass
class ActionPlanName:
    """A live action; empty lists and zero values keep what runs now."""
    shares: List[float] = field(default_factory=list)
    compression: List[int] = field(default_factory=list)  # CompressionMethod per layer
    topk_ratio: float = 0.0
    powersgd_rank: int = 0
    bucket_bytes: int = -1
    microbatch: int = 0
    layout: str = ""


@dataclass
class LabelPlanName:
    """A label for logs: the plan is its structured Layout alone."""
    label: str = ""


PlanName = Union[LayoutPlanName, ActionPlanName, LabelPlanName]


def kind(text: str) -> str:
    """"action", "layout" or "label": which kind `text` is read as (its first field only)."""
    if text == "keep" or (len(text) >= 2 and text[1] == "=" and text[0] in "sckrbml"):
        return "action"
    if len(text) >= 3 and text.startswith("dp") and text[2].isdigit():
        return "layout"
    return "label"


# ---- numbers (the C++ codec's rules) ----

def _int(text: str, what: str) -> int:
    t = text.strip(" \t")
    body = t[1:] if t[:1] in "+-" else t
    if not body or not body.isdigit() or t[:1] == "+":
        raise PlanNameError(f"{what}: '{t}' is not an integer")
    return int(t)


def _float(text: str, what: str) -> float:
    t = text.strip(" \t")
    try:
        v = float(t)
    except ValueError:
        v = math.nan
    if not t or not math.isfinite(v) or t.lower() in ("inf", "nan"):
        raise PlanNameError(f"{what}: '{t}' is not a finite number")
    return v


def _bounded(text: str, lo: int, hi: int, what: str) -> int:
    v = _int(text, what)
    if v < lo or v > hi:
        raise PlanNameError(f"{what}: {v} is outside [{lo}, {hi}]")
    return v


def _number(v: float) -> str:
    return "%.6g" % v


# ---- action texts ----

def _encode_action(a: ActionPlanName) -> str:
    fields = []
    if a.shares:
        fields.append("s=" + "/".join(_number(v) for v in a.shares))
    if a.compression:
        runs, i = [], 0
        while i < len(a.compression):
            j = i
            while j < len(a.compression) and a.compression[j] == a.compression[i]:
                j += 1
            runs.append(f"{j - i}{_CODE_OF[a.compression[i]]}")
            i = j
        fields.append("c=" + "".join(runs))
    if a.topk_ratio > 0:
        fields.append("k=" + _number(a.topk_ratio))
    if a.powersgd_rank > 0:
        fields.append(f"r={a.powersgd_rank}")
    if a.bucket_bytes >= 0:
        fields.append(f"b={a.bucket_bytes}")
    if a.microbatch > 0:
        fields.append(f"m={a.microbatch}")
    if a.layout:
        if ";" in a.layout:
            raise PlanNameError(f"live action: layout '{a.layout}' contains ';'")
        fields.append("l=" + a.layout)
    out = ";".join(fields) or "keep"
    if len(out) > MAX_NAME_BYTES:
        raise PlanNameError(f"live action too long for the bus ({len(out)} > {MAX_NAME_BYTES} "
                            f"bytes): {out}")
    return out


def _decode_compression(value: str, where: str) -> List[int]:
    out: List[int] = []
    i = 0
    while i < len(value):
        j = i
        while j < len(value) and value[j].isdigit():
            j += 1
        if j == i or j >= len(value):
            raise PlanNameError(f"{where}: bad compression run")
        n = _int(value[i:j], f"{where} c")
        if n < 1 or n > 65536:
            raise PlanNameError(f"{where}: bad compression run length")
        if value[j] not in _CODES:
            raise PlanNameError(f"{where}: unknown compression code '{value[j]}'")
        out += [_CODES[value[j]]] * n
        i = j + 1
    return out


def _decode_action(text: str) -> ActionPlanName:
    a = ActionPlanName()
    if text == "keep":
        return a
    where = f"live action '{text}'"
    for part in text.split(";"):
        if len(part) < 2 or part[1] != "=":
            raise PlanNameError(f"{where}: bad field '{part}'")
        key, value = part[0], part[2:]
        if key == "s":
            shares = [_float(v, f"{where} s") for v in value.split("/")]
            if any(v < 0 for v in shares):
                raise PlanNameError(f"{where}: negative share")
            total = sum(shares)
            if total <= 0:
                raise PlanNameError(f"{where}: shares sum to zero")
            a.shares = [v / total for v in shares]
        elif key == "c":
            a.compression += _decode_compression(value, where)
        elif key == "k":
            a.topk_ratio = _float(value, f"{where} k")
            if not 0 < a.topk_ratio <= 1:
                raise PlanNameError(f"{where}: k must be in (0, 1]")
        elif key == "r":
            a.powersgd_rank = _int(value, f"{where} r")
            if not 1 <= a.powersgd_rank <= 1024:
                raise PlanNameError(f"{where}: r must be in [1, 1024]")
        elif key == "b":
            a.bucket_bytes = _int(value, f"{where} b")
            if a.bucket_bytes < 0:
                raise PlanNameError(f"{where}: b must be >= 0")
        elif key == "m":
            a.microbatch = _int(value, f"{where} m")
            if a.microbatch < 1:
                raise PlanNameError(f"{where}: m must be >= 1")
        elif key == "l":
            if not value:
                raise PlanNameError(f"{where}: empty layout")
            a.layout = value
        else:
            raise PlanNameError(f"{where}: unknown field '{key}'")
    return a


# ---- layout names ----

def _encode_layout(n: LayoutPlanName) -> str:
    out = f"dp{n.dp}-tp{n.tp}-pp{n.pp}-mb{n.microbatch}"
    if n.sp:
        out += "-sp"
    if n.virtual_stages > 1:
        out += f"-v{n.virtual_stages}"
    out += f"-z{n.zero}"
    if n.elastic:
        out += "-elastic"
    if n.schedule is not None:
        if n.schedule not in _SCHEDULES:
            raise PlanNameError(f"layout name: sc '{n.schedule}'")
        out += ";sc=" + n.schedule
    if n.recompute is not None:
        if n.recompute not in _RECOMPUTES:
            raise PlanNameError(f"layout name: rc '{n.recompute}'")
        out += ";rc=" + n.recompute
    if n.stage_layers:
        out += ";st=" + ",".join(str(v) for v in n.stage_layers)
    if n.dp_shares:
        runs, i = [], 0
        while i < len(n.dp_shares):
            j = i
            while j < len(n.dp_shares) and n.dp_shares[j] == n.dp_shares[i]:
                j += 1
            runs.append(str(n.dp_shares[i]) + (f"*{j - i}" if j - i > 1 else ""))
            i = j
        out += ";sh=" + ",".join(runs)
    if n.gpus:
        ranges, i = [], 0
        while i < len(n.gpus):
            j = i + 1
            while j < len(n.gpus) and n.gpus[j] == n.gpus[j - 1] + 1:
                j += 1
            ranges.append(str(n.gpus[i]) + (f"-{n.gpus[j - 1]}" if j - i > 1 else ""))
            i = j
        out += ";g=" + ",".join(ranges)
    if len(out) > MAX_NAME_BYTES:
        raise PlanNameError(f"layout name too long for the bus ({len(out)} > {MAX_NAME_BYTES} "
                            "bytes)")
    return out


def _decode_head(head: str, where: str, n: LayoutPlanName) -> None:
    parts = head.split("-")
    i = 0

    def number(prefix: str, lo: int, hi: int) -> int:
        nonlocal i
        if i >= len(parts) or not parts[i].startswith(prefix):
            raise PlanNameError(f"{where}: head: expected '{prefix}<n>' at part {i + 1}")
        i += 1
        return _bounded(parts[i - 1][len(prefix):], lo, hi, f"{where} {prefix}")

    n.dp = number("dp", 1, MAX_RANKS)
    n.tp = number("tp", 1, MAX_RANKS)
    n.pp = number("pp", 1, MAX_RANKS)
    n.microbatch = number("mb", 1, _MAX_COUNT)
    if i < len(parts) and parts[i] == "sp":
        n.sp, i = True, i + 1
    if i < len(parts) and parts[i].startswith("v"):
        n.virtual_stages = number("v", 2, _MAX_COUNT)
    n.zero = number("z", 0, 3)
    if i < len(parts) and parts[i] == "elastic":
        n.elastic, i = True, i + 1
    if i != len(parts):
        raise PlanNameError(f"{where}: head: unexpected '{parts[i]}'")


def _decode_list(value: str, runs: bool, lo: int, what: str) -> List[int]:
    out: List[int] = []
    for item in value.split(","):
        head, star, count = item.partition("*") if runs else (item, "", "")
        v = _bounded(head, lo, MAX_RANKS, what)
        n = _bounded(count, 1, _MAX_COUNT, what) if star else 1
        if len(out) + n > _MAX_COUNT:
            raise PlanNameError(f"{what}: more than {_MAX_COUNT} entries")
        out += [v] * n
    return out


def _decode_ranges(value: str, what: str) -> List[int]:
    out: List[int] = []
    for item in value.split(","):
        a, dash, b = item.partition("-")
        first = _bounded(a, 0, MAX_RANKS, what)
        last = _bounded(b, first, MAX_RANKS, what) if dash else first
        if len(out) + last - first + 1 > _MAX_COUNT:
            raise PlanNameError(f"{what}: more than {_MAX_COUNT} entries")
        out += range(first, last + 1)
    return out


def _decode_layout(text: str) -> LayoutPlanName:
    where = f"layout name '{text}'"
    fields = text.split(";")
    n = LayoutPlanName()
    _decode_head(fields[0], where, n)
    for f in fields[1:]:
        key, eq, value = f.partition("=")
        if not eq:
            raise PlanNameError(f"{where}: bad field '{f}'")
        what = f"{where} {key}"
        if key == "sc":
            if value not in _SCHEDULES:
                raise PlanNameError(f"{what}: unknown schedule '{value}'")
            n.schedule = value
        elif key == "rc":
            if value not in _RECOMPUTES:
                raise PlanNameError(f"{what}: unknown recompute '{value}'")
            n.recompute = value
        elif key == "st":
            n.stage_layers = _decode_list(value, False, 0, what)
        elif key == "sh":
            n.dp_shares = _decode_list(value, True, 1, what)
        elif key == "g":
            n.gpus = _decode_ranges(value, what)
        else:
            raise PlanNameError(f"{where}: unknown field '{key}'")
    return n


# ---- the codec ----

def encode(name: PlanName) -> str:
    """The text of `name` (at most MAX_NAME_BYTES); PlanNameError when it cannot be written."""
    if isinstance(name, ActionPlanName):
        return _encode_action(name)
    if isinstance(name, LayoutPlanName):
        return _encode_layout(name)
    if kind(name.label) != "label" or ";" in name.label or "=" in name.label or \
            len(name.label) > MAX_NAME_BYTES:
        raise PlanNameError(f"plan label '{name.label}' would not read back as a label")
    return name.label


def decode(text: str) -> PlanName:
    """The typed plan name of `text`; PlanNameError naming the field on malformed text."""
    k = kind(text)
    if k == "action":
        return _decode_action(text)
    if k == "layout":
        return _decode_layout(text)
    if ";" in text or "=" in text:
        raise PlanNameError(f"plan name '{text}': neither a layout name (dp<n>-...), a live "
                            "action (keep, s=..., ...) nor a label (no ';' or '=')")
    return LabelPlanName(text)
