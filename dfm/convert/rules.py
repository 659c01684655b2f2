"""Name-and-layout rules between a published model's state dict and dfm's global parameter names.

A family (Wan, FLUX, ...) lists one ``Rule`` per dfm parameter: which diffusers tensors it is made
from (``join``) and how to get them back (``split``, the exact inverse). Importing and exporting
walk the same list, so a round trip reproduces every tensor bit for bit, and a key that no rule
reads, or a rule whose key is absent, stops the conversion naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


class ConversionError(ValueError):
    """A state dict does not fit a family's rules; the message names the keys at fault."""


def _only(tensors: list[Tensor]) -> Tensor:
    return tensors[0]


def _as_list(tensor: Tensor) -> list[Tensor]:
    return [tensor]


@dataclass(frozen=True)
class Rule:
    """One dfm parameter (its global name, ``layers.<global index>...``) from one or more diffusers tensors."""

    dfm: str
    diffusers: tuple[str, ...]
    join: Callable[[list[Tensor]], Tensor] = _only  # diffusers tensors -> the dfm tensor
    split: Callable[[Tensor], list[Tensor]] = _as_list  # the exact inverse of join


def rename(dfm: str, diffusers: str) -> Rule:
    """The same tensor under another name."""
    return Rule(dfm, (diffusers,))


def concat(dfm: str, diffusers: Sequence[str], sizes: Sequence[int], dim: int = 0) -> Rule:
    """dfm's tensor is the diffusers tensors concatenated along ``dim`` (``sizes`` along it)."""
    sizes = list(sizes)
    return Rule(
        dfm,
        tuple(diffusers),
        join=lambda tensors: torch.cat(tensors, dim=dim),
        split=lambda tensor: list(torch.split(tensor, sizes, dim=dim)),
    )


def _interleave(parts: list[Tensor], counts: Sequence[int], groups: int) -> Tensor:
    """Rows of ``parts`` (each [groups * count_i * hn, ...]) interleaved per group: [g0: p0, p1, ..; g1: ..]."""
    per_group = [part.reshape(groups, count, -1, *part.shape[1:]) for part, count in zip(parts, counts)]
    merged = torch.cat(per_group, dim=1)
    return merged.reshape(-1, *parts[0].shape[1:])


def _deinterleave(tensor: Tensor, counts: Sequence[int], groups: int) -> list[Tensor]:
    """The inverse of ``_interleave``: each part back as one contiguous [groups * count_i * hn, ...]."""
    total = sum(counts)
    grouped = tensor.reshape(groups, total, -1, *tensor.shape[1:])
    parts = torch.split(grouped, list(counts), dim=1)
    return [part.reshape(-1, *tensor.shape[1:]).contiguous() for part in parts]


def fused_qkv(dfm: str, q: str, k: str, v: str, num_heads: int, num_query_groups: int | None = None) -> Rule:
    """megatron ``SelfAttention.linear_qkv`` (weight or bias): per query group g, [q heads of g, k_g, v_g] on dim 0."""
    groups = num_query_groups or num_heads
    if num_heads % groups:
        raise ConversionError(f"{dfm}: {num_heads} heads do not split into {groups} query groups")
    counts = (num_heads // groups, 1, 1)
    return Rule(
        dfm,
        (q, k, v),
        join=lambda tensors: _interleave(tensors, counts, groups),
        split=lambda tensor: _deinterleave(tensor, counts, groups),
    )


def fused_kv(dfm: str, k: str, v: str, num_heads: int) -> Rule:
    """megatron ``CrossAttention.linear_kv`` (weight or bias): per head [k_h, v_h] on dim 0."""
    return Rule(
        dfm,
        (k, v),
        join=lambda tensors: _interleave(tensors, (1, 1), num_heads),
        split=lambda tensor: _deinterleave(tensor, (1, 1), num_heads),
    )


def check_keys(names: Iterable[str], rules: Sequence[Rule], reading: str, source: str) -> None:
    """Every name the ``reading`` side ('diffusers' or 'dfm') of ``rules`` needs is in ``names``, and no other."""
    importing = reading == "diffusers"
    wanted = [name for rule in rules for name in (rule.diffusers if importing else (rule.dfm,))]
    available = set(names)
    missing = [name for name in wanted if name not in available]
    unused = sorted(available - set(wanted))
    if missing or unused:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} key(s): {', '.join(missing[:8])}")
        if unused:
            problems.append(f"{len(unused)} key(s) no rule reads: {', '.join(unused[:8])}")
        raise ConversionError(f"{source} does not match the rules: {'; '.join(problems)}")


def convert_stream(
    read: Callable[[str], Tensor], names: Iterable[str], rules: Sequence[Rule], reading: str, source: str
) -> Iterator[tuple[str, Tensor]]:
    """Apply every rule from the ``reading`` side, reading each tensor when its rule runs: (name, tensor)
    of the other side in rule order. Unknown and missing keys raise before the first tensor is read."""
    check_keys(names, rules, reading, source)
    for rule in rules:
        if reading == "diffusers":
            yield rule.dfm, rule.join([read(name) for name in rule.diffusers])
            continue
        parts = rule.split(read(rule.dfm))
        if len(parts) != len(rule.diffusers):
            raise ConversionError(f"{rule.dfm}: split gave {len(parts)} tensors for {len(rule.diffusers)} names")
        yield from zip(rule.diffusers, parts)


def to_dfm(diffusers_state: dict[str, Tensor], rules: Sequence[Rule], source: str = "the diffusers state dict"):
    """Diffusers tensors -> {dfm global name: tensor}."""
    return dict(convert_stream(diffusers_state.__getitem__, diffusers_state, rules, "diffusers", source))


def to_diffusers(dfm_state: dict[str, Tensor], rules: Sequence[Rule], source: str = "the dfm weights"):
    """{dfm global name: tensor} -> diffusers tensors."""
    return dict(convert_stream(dfm_state.__getitem__, dfm_state, rules, "dfm", source))
