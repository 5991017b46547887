"""Reply contracts: every field our parsers read from a vLLM/SGLang reply must exist upstream.

A renamed reply field fails quietly: our vLLM client, finding no ``weight_versions`` spans, would stamp
every token with the version ``/weight_info`` reports afterwards. The recorder notes each field our code
reads (``choices[].weight_versions[].start``); the checker then looks for it:

* in the reply model of :data:`REPLIES` (vLLM's pydantic response models), field by field down the path;
* else in the handler's own dict literals (``JSONResponse(content={"world_size": ...})``), for a
  top-level field, and below it along the model :data:`REPLY_FIELDS` names for that field (vLLM's
  ``/server_info?config_format=json`` dumps ``VllmConfig``: we read
  ``vllm_config.weight_transfer_config.backend``);
* else (replies assembled elsewhere, e.g. SGLang's ``meta_info``) anywhere in the release's sources, as a
  string literal or an annotated field: a weaker check that still catches a rename.

:data:`ENVELOPE` fields (``success``, ``message``, ...) are read by the adapters from every reply as a
generic error check and are not looked up.
"""

from __future__ import annotations

import ast
import re

from slipstream.contracts.ours import HttpCall
from slipstream.contracts.problems import Problem
from slipstream.contracts.upstream import ClassInfo, SourceTree

REPLIES: dict[tuple[str, str], tuple[str, str]] = {
    ("vllm", "/v1/completions"): ("CompletionResponse", "vllm/entrypoints/openai/completion/protocol.py"),
    ("vllm", "/inference/v1/generate"): (
        "GenerateTokensResponse",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py",
    ),
    ("vllm", "/v1/models"): ("ModelList", "vllm/entrypoints/serve/engine/protocol.py"),
}
# (server kind, path, top-level reply field) -> the model that field is a dump of (class, file).
REPLY_FIELDS: dict[tuple[str, str, str], tuple[str, str]] = {
    ("vllm", "/server_info", "vllm_config"): ("VllmConfig", "vllm/config/vllm.py"),
}
ENVELOPE = {"success", "message", "error", "detail"}


def _field_classes(tree: SourceTree, cls: ClassInfo, name: str) -> list[ClassInfo]:
    """Model classes named in the annotation of ``cls.name`` (``list[Choice] | None`` gives Choice)."""
    f = cls.fields[name]
    out = []
    for node in ast.walk(f.annotation) if f.annotation is not None else []:
        if isinstance(node, (ast.Name, ast.Attribute)):
            res = tree.resolve(f.module, ast.unparse(node))
            if res is not None and res.kind == "class":
                info = tree.class_info(res.file, res.node)  # type: ignore[arg-type]
                if info.kind in ("pydantic", "dataclass", "msgspec"):
                    out.append(info)
    return out


def check_model_path(tree: SourceTree, cls: ClassInfo, path: str) -> tuple[str, ClassInfo] | None:
    """The first segment of ``path`` (``a[].b.c``) missing from the models along it, and that model."""
    current = [cls]
    for seg in path.split("."):
        name = seg.removesuffix("[]")
        owners = [c for c in current if name in c.fields]
        if not owners:
            return name, current[0]
        current = [k for c in owners for k in _field_classes(tree, c, name)]
        if not current:
            return None  # a scalar, a dict or a list of scalars: nothing further to check
    return None


def _dict_keys(fn: ast.AST) -> set[str]:
    return {
        k.value
        for node in ast.walk(fn)
        if isinstance(node, ast.Dict)
        for k in node.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }


def _mentioned(tree: SourceTree, keys: set[str]) -> set[str]:
    """Those of ``keys`` that appear upstream as a string literal or an annotated field (one pass)."""
    if not keys:
        return set()
    alt = "|".join(sorted(map(re.escape, keys)))
    rx = re.compile(rf"""["']({alt})["']|^\s+({alt})\s*:""", re.M)
    found: set[str] = set()
    for rel in tree.files:
        found |= {a or b for a, b in rx.findall(tree.text(rel))}
        if found >= keys:
            break
    return found


def _nested_reads(
    tree: SourceTree, kind: str, path: str, paths: set[str], where: str, origin: str
) -> list[Problem]:
    """Reads below a top-level field that is a dump of a model (:data:`REPLY_FIELDS`), checked along it."""
    out: list[Problem] = []
    for (k, p, top), (name, near) in REPLY_FIELDS.items():
        below = sorted(
            r.split(".", 1)[1]
            for r in paths
            if k == kind and p == path and "." in r and r.split(".")[0] == top
        )
        if not below:
            continue
        cls = tree.find_class(name, near=near if near in tree.files else None)
        if cls is None:
            out.append(
                Problem(where, top, f"upstream model {name} (which {top} dumps) is gone", near, origin)
            )
            continue
        for rest in below:
            missing = check_model_path(tree, cls, rest)
            if missing is not None:
                msg = f"is read by our parser but {missing[1].name} has no field `{missing[0]}`"
                out.append(Problem(where, f"{top}.{rest}", msg, missing[1].file, origin))
    return out


def check_replies(trees: dict[str, SourceTree], calls: list[HttpCall]) -> list[Problem]:
    reads: dict[tuple[str, str, str], tuple[set[str], str]] = {}
    for c in calls:
        entry = reads.setdefault((c.kind, c.method, c.path), (set(), c.origin))
        entry[0].update(c.reads)
    problems: list[Problem] = []
    for (kind, method, path), (paths, origin) in sorted(reads.items()):
        tree, where = trees[kind], f"{kind} {method} {path} (reply)"
        paths = {p for p in paths if p.split(".")[0].removesuffix("[]") not in ENVELOPE}
        if not paths:
            continue
        model = REPLIES.get((kind, path))
        if model is not None:
            cls = tree.find_class(model[0], near=model[1] if model[1] in tree.files else None)
            if cls is None:
                problems.append(
                    Problem(where, "", f"upstream reply model {model[0]} is gone", model[1], origin)
                )
                continue
            for p in sorted(paths):
                missing = check_model_path(tree, cls, p)
                if missing is not None:
                    msg = f"is read by our parser but {missing[1].name} has no field `{missing[0]}`"
                    problems.append(Problem(where, p, msg, missing[1].file, origin))
            continue
        routes = tree.find_routes(path, method)
        keys = set().union(*(_dict_keys(r.handler) for r in routes)) if routes else set()
        problems += _nested_reads(tree, kind, path, paths, where, origin)
        unmatched = [p for p in sorted(paths) if p.split(".")[0].removesuffix("[]") not in keys]
        mentioned = _mentioned(tree, {p.split(".")[-1].removesuffix("[]") for p in unmatched})
        for p in unmatched:
            if p.split(".")[-1].removesuffix("[]") not in mentioned:
                upstream = routes[0].file if routes else ""
                problems.append(
                    Problem(where, p, "is read by our parser but appears nowhere upstream", upstream, origin)
                )
    return problems
