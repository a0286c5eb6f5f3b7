"""Every cross-field rule of the H3Deployment spec, written once as data.

A rule is a check, a message template and the field it is reported on. The check is a small expression over the
spec's camelCase document (`H3DeploymentSpec.to_dict()`: defaults filled in, unset optionals absent, exactly what
the API server's CEL sees) that Python evaluates and that renders itself as CEL; the message template's
placeholders are expressions too, so the CRD's `messageExpression` is generated from the same text. `validate` in
`h3serve.config.spec` runs the checks; `h3serve.operator.crd` writes them into `x-kubernetes-validations`.
The degree rules take their allowed values from `h3serve.config.parallel`.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable

from h3serve.config.parallel import (
    ENCODER_TP_MESSAGE,
    ULYSSES_MESSAGE,
    VAE_PP_MESSAGE,
    encoder_tp_choices,
    join_choices,
    ulysses_choices,
    vae_pp_choices,
)
from h3serve.config.lora import FP8_REFUSAL
from h3serve.config.levers import FASTH3_REFUSED, LEVER, LEVERS_MESSAGE, SPEC_NAMES, STAGED_VAE_MESSAGE
from h3serve.config.vocab import DIT_HEADS, ENCODER_HEADS, ENCODER_KV_HEADS, PIPELINE_STAGES

# ---- expressions: evaluated in Python, rendered as CEL -----------------------------------------------------------


class Expr:
    def value(self, doc: dict) -> Any:
        raise NotImplementedError

    def cel(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Field(Expr):
    """A field of the spec by its dotted camelCase path; None when unset (CEL: `has()` guards it)."""

    path: str

    def value(self, doc: dict) -> Any:
        for part in self.path.split("."):
            doc = doc.get(part) if isinstance(doc, dict) else None
        return doc

    def cel(self) -> str:
        return "self." + self.path


@dataclass(frozen=True)
class Lit(Expr):
    v: Any

    def value(self, doc: dict) -> Any:
        return self.v

    def cel(self) -> str:
        return json.dumps(self.v)  # ints and (double-quoted) strings are spelled the same in CEL


@dataclass(frozen=True)
class ListOf(Expr):
    items: tuple[Expr, ...]

    def value(self, doc: dict) -> Any:
        return [x.value(doc) for x in self.items]

    def cel(self) -> str:
        return "[" + ", ".join(x.cel() for x in self.items) + "]"


@dataclass(frozen=True)
class Op(Expr):
    """An operator; `||` and `&&` short-circuit as in CEL (a guarded field is never read when unset)."""

    op: str
    args: tuple[Expr, ...]

    def value(self, doc: dict) -> Any:
        if self.op == "||":
            return any(a.value(doc) for a in self.args)
        if self.op == "&&":
            return all(a.value(doc) for a in self.args)
        return _PY[self.op](*(a.value(doc) for a in self.args))

    def cel(self) -> str:
        inner = [x.cel() for x in self.args]
        if self.op == "has":
            return f"has({inner[0]})"
        a = [f"({c})" if self._needs_parens(x) else c for x, c in zip(self.args, inner)]
        if self.op == "!":
            return "!" + a[0]
        if self.op in ("startsWith", "matches"):
            return f"{a[0]}.{self.op}({inner[1]})"
        return f" {self.op} ".join(a)

    def _needs_parens(self, operand: Expr) -> bool:
        """An operand binding no tighter than this operator, or an `&&` inside `||` (for the reader); chains of the
        same `||` / `&&` go without."""
        if not isinstance(operand, Op) or operand.op not in _PRECEDENCE:
            return False
        if operand.op == self.op and self.op in ("||", "&&"):
            return False
        return operand.op == "&&" or _PRECEDENCE[operand.op] <= _PRECEDENCE.get(self.op, 9)


_PRECEDENCE = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<=": 3, "in": 3, "+": 4, "*": 5, "%": 5}  # as in CEL
_PY: dict[str, Callable] = {
    "has": lambda v: v is not None, "!": lambda v: not v,
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<=": lambda a, b: a <= b,
    "%": lambda a, b: a % b, "*": lambda a, b: a * b, "+": lambda a, b: a + b, "in": lambda a, b: a in b,
    "startsWith": lambda a, b: a.startswith(b),
    "matches": lambda a, b: re.search(b, a) is not None,  # CEL's matches() is unanchored (RE2), like re.search
}


def _x(v: Any) -> Expr:
    if isinstance(v, Expr):
        return v
    if isinstance(v, (list, tuple)):
        return ListOf(tuple(_x(i) for i in v))
    return Lit(v)


def op(name: str, *args: Any) -> Op:
    return Op(name, tuple(_x(a) for a in args))


def any_of(*xs: Any) -> Op:
    return op("||", *xs)


def all_of(*xs: Any) -> Op:
    return op("&&", *xs)


def has(path: str) -> Op:
    return op("has", Field(path))


def unset(path: str) -> Op:
    return op("!", has(path))


# ---- rules ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One cross-field rule: `check` must hold; else `message` (placeholders filled from `args`) is reported on
    `field` (dotted, below spec). An arg is an expression over the spec or a constant of the text."""

    field: str
    check: Expr
    message: str
    args: dict[str, Any] = field(default_factory=dict)

    def holds(self, doc: dict) -> bool:
        return bool(self.check.value(doc))

    def format(self, doc: dict) -> str:
        return self.message.format(**{k: v.value(doc) if isinstance(v, Expr) else v for k, v in self.args.items()})

    def cel_message(self) -> str:
        """The message as a CEL `messageExpression`: `"...%d...".format([<args>])`, `%d` for a `{name:d}`
        placeholder, `%s` for the others. (A concatenation with `string(int)` would not do: the API server's cost
        estimator cannot bound its length and refuses the CRD.)"""
        text, cel_args = "", []
        for literal, name, spec, _conv in string.Formatter().parse(self.message):
            text += literal.replace("%", "%%")
            if name is None:
                continue
            arg = self.args[name]
            if isinstance(arg, Expr):
                text += "%d" if spec == "d" else "%s"
                cel_args.append(arg.cel())
            else:
                text += format(arg, spec).replace("%", "%%")  # a constant: part of the literal text
        return f"{json.dumps(text)}.format([{', '.join(cel_args)}])" if cel_args else json.dumps(text)


# How the spec spells each degree in the degree rules' messages (h3serve.config.parallel).
FIELD_NAMES = {"encoder_tp": "encoder.tensorParallel", "ulysses": "dit.ulysses", "ring": "dit.ring",
               "vae_pp": "vae.patchParallel"}
TP = Field("encoder.tensorParallel")
DIT_SP = op("*", Field("dit.ulysses"), Field("dit.ring"))  # the DiT's GPUs: one per sequence-parallel rank
GPN = Field("gpusPerNode")
COLOCATED = op("==", Field("placement"), "colocated")
DISAGGREGATED = op("==", Field("placement"), "disaggregated")
WHOLE_NODES = "a stage larger than a node must span whole nodes (a multiple of gpusPerNode)"


# The front door runs one gateway, or shares its jobs through an object store.
ONE_GATEWAY = any_of(
    has("gateway.jobStore"),
    all_of(COLOCATED, any_of(unset("replicas"), op("<=", Field("replicas"), 1))),
    all_of(DISAGGREGATED, unset("gateway.autoscaling"),
           any_of(unset("gateway.replicas"), op("<=", Field("gateway.replicas"), 1))),
    all_of(DISAGGREGATED, has("gateway.autoscaling"), op("<=", Field("gateway.autoscaling.maxReplicas"), 1)),
)


def _inside_mount(path: str) -> Op:
    return op("startsWith", Field(path), op("+", Field("model.mountPath"), "/"))


# A path with no "." or ".." segment and no empty one: the prefix checks above hold for it exactly as they would for
# its normalised form (CEL cannot normalise a path, so a path that is not already normal is refused).
NOT_NORMAL = r"(^|/)[.][.]?(/|$)|//"
NORMAL_PATH = "{path} must be a normalised absolute path (no '.', '..' or empty segments)"


def _normal(path: str) -> Op:
    return op("!", op("matches", Field(path), NOT_NORMAL))


def _not_positive(path: str) -> Op:
    """True when `path` is 0 or less, the escape of a rule that divides by it: the schema's minimum already refuses
    such a value, but CEL rules run too and must not divide by it."""
    return op("<=", Field(path), 0)


@dataclass(frozen=True)
class EveryLoraPath(Expr):
    """Every dit.loras entry's path passes `check` (an Expr over the spec, given the path as `Field("$path")`)."""

    check: Expr

    def value(self, doc: dict) -> Any:
        items = Field("dit.loras").value(doc) or []
        return all(self.check.value({**doc, "$path": item.get("path", "")}) for item in items)

    def cel(self) -> str:
        return f"self.dit.loras.all(l, {self.check.cel().replace('self.$path', 'l.path')})"


FAST_SP = op("*", Field("fasth3.ulysses"), Field("fasth3.ring"))  # the FastH3 pool's GPUs per replica
NO_FAST = unset("fasth3")


def _autoscaling_rules(st: str) -> tuple[Rule, ...]:
    auto = f"{st}.autoscaling"
    return (
        Rule(auto, any_of(unset(auto), op("<=", Field(f"{auto}.minReplicas"), Field(f"{auto}.maxReplicas"))),
             f"{auto}.minReplicas={{lo}} must be at most {auto}.maxReplicas={{hi}}",
             dict(lo=Field(f"{auto}.minReplicas"), hi=Field(f"{auto}.maxReplicas"))),
        Rule(f"{st}.replicas", any_of(unset(auto), unset(f"{st}.replicas")),
             f"set {st}.replicas or {st}.autoscaling, not both: with autoscaling the autoscaler sets the replicas "
             f"(between minReplicas and maxReplicas)"),
        Rule(auto, any_of(unset(auto), DISAGGREGATED),
             f"{auto} only applies to disaggregated placement: with placement colocated set spec.replicas"),
    )


def _lever_off(row) -> Expr:
    """A lever of the table at its default: unset, false, or its default choice ("off")."""
    path = row.metadata["spec"]
    if row.default is None:
        return unset(path)
    if isinstance(row.default, str):
        return any_of(unset(path), op("==", Field(path), row.default))
    return op("!", Field(path))


RULES: tuple[Rule, ...] = (
    Rule("encoder.tensorParallel", op("in", TP, encoder_tp_choices()), ENCODER_TP_MESSAGE,
         dict(FIELD_NAMES, tp=TP, heads=ENCODER_HEADS, kv=ENCODER_KV_HEADS,
              choices=join_choices(encoder_tp_choices()))),
    Rule("dit.ulysses", op("in", Field("dit.ulysses"), ulysses_choices()), ULYSSES_MESSAGE,
         dict(FIELD_NAMES, u=Field("dit.ulysses"), heads=DIT_HEADS, choices=join_choices(ulysses_choices()))),
    Rule("vae.patchParallel", op("in", Field("vae.patchParallel"), vae_pp_choices(DIT_SP)), VAE_PP_MESSAGE,
         dict(FIELD_NAMES, pp=Field("vae.patchParallel"), sp=DIT_SP)),
    Rule("model.adapter", any_of(op("!=", Field("profile"), "fasth3"),
                                 all_of(has("model.adapter"), has("model.adapter.sha256"))),
         "profile fasth3 needs model.adapter with path and sha256 (the FastH3 4-step adapter file and its checksum)"),
    Rule("dit.levers", any_of(op("!=", Field("profile"), "fasth3"),
                              all_of(*(_lever_off(LEVER[name]) for name in FASTH3_REFUSED))),
         LEVERS_MESSAGE, dict(SPEC_NAMES)),
    Rule("vae.levers.staged", any_of(op("!", Field("vae.levers.staged")), op("==", Field("vae.patchParallel"), 1)),
         STAGED_VAE_MESSAGE, dict(SPEC_NAMES, pp=Field("vae.patchParallel"))),
    Rule("placement", any_of(DISAGGREGATED, all_of(*(unset(f"{s}.replicas") for s in (*PIPELINE_STAGES, "gateway")))),
         "per-stage replicas only apply to disaggregated placement: with placement colocated set spec.replicas and "
         "remove encoder/dit/vae/muxer/gateway.replicas (each colocated replica runs its own gateway)"),
    Rule("encoder.tensorParallel", any_of(DISAGGREGATED, _not_positive("encoder.tensorParallel"),
                                          op("==", op("%", DIT_SP, TP), 0)),
         "encoder.tensorParallel={tp:d} must divide the {sp:d} GPUs of a colocated replica (dit.ulysses x dit.ring)",
         dict(tp=TP, sp=DIT_SP)),
    Rule("dit", any_of(_not_positive("gpusPerNode"), op("<=", DIT_SP, GPN), op("==", op("%", DIT_SP, GPN), 0)),
         "dit needs {n:d} GPUs, more than gpusPerNode={gpn:d}: {whole}", dict(n=DIT_SP, gpn=GPN, whole=WHOLE_NODES)),
    Rule("encoder", any_of(COLOCATED, _not_positive("gpusPerNode"), op("<=", TP, GPN), op("==", op("%", TP, GPN), 0)),
         "encoder needs {n:d} GPUs, more than gpusPerNode={gpn:d}: {whole}", dict(n=TP, gpn=GPN, whole=WHOLE_NODES)),
    Rule("model.path", any_of(unset("model.volume"), _inside_mount("model.path")),
         "model.path {path} must be inside model.mountPath {mount}, where model.volume is mounted",
         dict(path=Field("model.path"), mount=Field("model.mountPath"))),
    Rule("model.adapter.path",
         any_of(unset("model.volume"), unset("model.adapter"), _inside_mount("model.adapter.path")),
         "model.adapter.path {path} must be inside model.mountPath {mount}, where model.volume is mounted",
         dict(path=Field("model.adapter.path"), mount=Field("model.mountPath"))),
    *(rule for st in (*PIPELINE_STAGES, "gateway") for rule in _autoscaling_rules(st)),
    Rule("gateway.auth", op("!=", has("gateway.auth.apiKeysSecret"), Field("gateway.auth.disabled")),
         "gateway.auth needs exactly one of gateway.auth.apiKeysSecret (the Secret whose key keys holds the callers' "
         "hashed API keys) or gateway.auth.disabled: true (the front door then serves anyone who can reach it)"),
    Rule("gateway.jobStore", ONE_GATEWAY,
         "more than one gateway (gateway.replicas, gateway.autoscaling.maxReplicas, or a colocated spec.replicas: "
         "each colocated replica runs its own gateway) needs gateway.jobStore, so that every gateway sees every "
         "job: set gateway.jobStore.s3 or run one gateway"),
    Rule("fasth3", any_of(NO_FAST, op("==", Field("profile"), "base")),
         "fasth3 (a FastH3 pool beside the base one) needs profile base, got profile {p}: a fasth3 deployment "
         "serves FastH3 alone; remove spec.fasth3", dict(p=Field("profile"))),
    Rule("fasth3", any_of(NO_FAST, DISAGGREGATED),
         "fasth3 needs placement disaggregated: a colocated replica is one engine pod running every stage on the "
         "same GPUs, and a second DiT pool inside it is not built; use placement disaggregated or remove spec.fasth3"),
    Rule("fasth3.adapter", any_of(NO_FAST, has("fasth3.adapter.sha256")),
         "fasth3.adapter needs sha256 (the lower-case hex sha256 of the FastH3 adapter file): the pool refuses a "
         "file that does not match"),
    Rule("fasth3.ulysses", any_of(NO_FAST, op("in", Field("fasth3.ulysses"), ulysses_choices())), ULYSSES_MESSAGE,
         dict(FIELD_NAMES, ulysses="fasth3.ulysses", ring="fasth3.ring", u=Field("fasth3.ulysses"), heads=DIT_HEADS,
              choices=join_choices(ulysses_choices()))),
    Rule("fasth3", any_of(NO_FAST, _not_positive("gpusPerNode"), op("<=", FAST_SP, GPN),
                          op("==", op("%", FAST_SP, GPN), 0)),
         "fasth3 needs {n:d} GPUs, more than gpusPerNode={gpn:d}: {whole}", dict(n=FAST_SP, gpn=GPN, whole=WHOLE_NODES)),
    Rule("fasth3.adapter.path",
         any_of(NO_FAST, all_of(_normal("fasth3.adapter.path"),
                                any_of(unset("model.volume"), _inside_mount("fasth3.adapter.path")))),
         "fasth3.adapter.path {path} must be a normalised absolute path (no '.', '..' or empty segments) inside "
         "model.mountPath {mount} when model.volume is set",
         dict(path=Field("fasth3.adapter.path"), mount=Field("model.mountPath"))),
    Rule("model.path", _normal("model.path"), "model.path " + NORMAL_PATH, dict(path=Field("model.path"))),
    Rule("model.mountPath", _normal("model.mountPath"), "model.mountPath " + NORMAL_PATH,
         dict(path=Field("model.mountPath"))),
    Rule("model.adapter.path", any_of(unset("model.adapter"), _normal("model.adapter.path")),
         "model.adapter.path " + NORMAL_PATH, dict(path=Field("model.adapter.path"))),
    Rule("dit.loras", any_of(unset("dit.loras"), op("!=", Field("profile"), "fasth3")),
         "dit.loras (per-request LoRA) needs profile base: profile fasth3 runs its fused 4-step adapter only"),
    Rule("dit.loras", any_of(unset("dit.loras"), op("!", Field("dit.levers.fp8"))), FP8_REFUSAL),
    Rule("dit.loras", any_of(unset("dit.loras"), EveryLoraPath(_normal("$path"))),
         "every dit.loras path must be a normalised absolute path (no '.', '..' or empty segments)"),
    Rule("dit.loras", any_of(unset("dit.loras"), unset("model.volume"), EveryLoraPath(_inside_mount("$path"))),
         "every dit.loras path must be inside model.mountPath {mount}, where model.volume is mounted",
         dict(mount=Field("model.mountPath"))),
)
