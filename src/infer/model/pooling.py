"""How a model turns hidden states into an embedding: its sentence-transformers configuration.

Embedding checkpoints published for sentence-transformers say how they pool in two files::

    modules.json              [{"type": "sentence_transformers.models.Transformer", ...},
                               {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                               {"type": "sentence_transformers.models.Normalize", ...}]
    1_Pooling/config.json     {"pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": false, ...}

A decoder pools the last token (most decoder-only embedding models are trained for it) or
the mean of every prompt token's state (stella's, KaLM's: summed chunk by chunk as the prompt
runs, so prefix caching is off for such a model); an encoder
(BERT, RoBERTa: its prompt runs whole, every token seeing every other) the first token (CLS),
the mean of every token's state (MEAN, special tokens included, as sentence-transformers
averages them) or the last. ``Dense`` modules after the pooling (LaBSE's, stella's) project
the pooled vector, each ``act(W x + b)`` (:mod:`infer.model.dense`), before it is normalized::

    2_Dense/config.json       {"in_features": 768, "out_features": 768, "bias": true,
                               "activation_function": "torch.nn.modules.activation.Tanh"}
    2_Dense/model.safetensors linear.weight, linear.bias     (or pytorch_model.bin)

A model whose files ask for another pooling, or hold a module infer does not run, is served,
but its embedding requests are refused naming why and ``--pooler-config``, which sets or
replaces what the files say (vLLM's flag). A model without these files pools the last token
(an encoder: CLS, or the mean where its ``config.json`` says ``emb_pooler: mean``, as Jina
BERT's does) and normalizes, as vLLM's embed runner does.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from infer.model.folders import ModelLoadError, read_json

SUPPORTED = ("LAST", "MEAN")  # a decoder's (its first is the default)
ENCODER_SUPPORTED = ("CLS", "MEAN", "LAST")  # an encoder's (its first is the default)
# sentence-transformers' pooling config key -> the pooling type's name (vLLM's names)
MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_max_tokens": "MAX",
    "pooling_mode_weightedmean_tokens": "WEIGHTED_MEAN",
    "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
}
_TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_DENSE_MODULE = "sentence_transformers.models.Dense"
_PYLATE_DENSE_MODULE = "pylate.models.Dense.Dense"  # (a ColBERT's projection of every token)
_DENSE_MODULES = (_DENSE_MODULE, _PYLATE_DENSE_MODULE)
_KNOWN_MODULES = (_TRANSFORMER_MODULE, _POOLING_MODULE, _NORMALIZE_MODULE, *_DENSE_MODULES)
# A Dense module's activation_function (torch's class path) -> its name here
DENSE_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.SiLU": "silu",
}


@dataclass(frozen=True)
class DenseLayer:
    """One sentence-transformers ``Dense`` module: ``act(W x + b)`` from ``in_features`` to
    ``out_features`` (``activation``: a name of :data:`DENSE_ACTIVATIONS`' values), its
    weights in the folder ``path``."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str
    # The file holding the weights (None: ``model.safetensors``, else ``pytorch_model.bin``)
    # and the prefix of their names (BGE-M3's ``colbert_linear.pt``: none).
    file: str | None = None
    prefix: str = "linear."


@dataclass(frozen=True)
class LateInteraction:
    """A ColBERT model's encoding of queries and documents (PyLate's
    ``config_sentence_transformers.json``; :mod:`infer.model.late_interaction` applies it):
    ``query_prefix`` / ``document_prefix``: the token inserted after the first (``[Q] ``,
    ``[D] ``; "" none); a query cut to ``query_length`` tokens and, with ``query_expansion``,
    padded to it with mask tokens, attended to only with ``attend_to_expansion``; a document
    cut to ``document_length``, its ``skiplist_words``' tokens left out of its vectors."""

    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    query_expansion: bool = True
    attend_to_expansion: bool = False
    skiplist_words: tuple[str, ...] = tuple(string.punctuation)  # (PyLate's default)


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type``: how the prompt's hidden states become one vector (``SUPPORTED``;
    an encoder's ``ENCODER_SUPPORTED``); ``normalize``: whether an embedding is scaled to unit
    length unless the request says; ``source``: where these came from (for errors and the
    start-up log); ``problem``: why embedding requests are refused (None: served);
    ``dense``: the projections after the pooling, in order; ``late_interaction``: a ColBERT
    model's query and document encoding (its vectors are every token's, scored by MaxSim),
    None for any other; ``tokens_problem``: why token embeddings are refused too."""

    pooling_type: str = "LAST"
    normalize: bool = True
    source: str = "infer's default"
    problem: str | None = None
    dense: tuple[DenseLayer, ...] = ()
    late_interaction: LateInteraction | None = None
    # A token embedding's own projection in place of ``dense``, of the rows after the
    # input's first ``token_first`` (BGE-M3's multi-vector output: ``colbert_linear.pt`` over
    # every token but its CLS); None: ``dense``, every row.
    token_dense: tuple[DenseLayer, ...] | None = None
    token_first: int = 0
    # BGE-M3's sparse (lexical) weights: ``sparse_linear.pt``, a ``Linear(hidden, 1)`` over
    # every token's state but its first and last (``token_classify``; ReLU its activation),
    # None: none; ``sparse_problem``: why a folder's such file cannot be read.
    sparse: DenseLayer | None = None
    sparse_problem: str | None = None
    # Why not even every token's vector can be given (a module infer does not run, a file it
    # cannot read), None where only the pooling is the problem (or nothing is).
    tokens_problem: str | None = None

    @property
    def supported(self) -> bool:
        return self.problem is None

    def embedding_size(self, hidden_size: int) -> int:
        """How many values an embedding has: the last projection's, else the hidden size."""
        return self.dense[-1].out_features if self.dense else hidden_size

    def token_size(self, hidden_size: int) -> int:
        """How many values a token embedding has (its own projection's, or an embedding's)."""
        if self.token_dense:
            return self.token_dense[-1].out_features
        return self.embedding_size(hidden_size)


def parse_pooler_config(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--pooler-config``: a JSON object with ``pooling_type`` and/or ``normalize``."""
    from infer.config import json_object

    if text is None or text == "":
        return {}
    data = json_object(text, "--pooler-config")
    unknown = sorted(set(data) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"--pooler-config: unknown field(s) {', '.join(unknown)} "
                         "(known: pooling_type, normalize)")  # fmt: skip
    if "pooling_type" in data:
        kind = data["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in ENCODER_SUPPORTED:
            raise ValueError(f"--pooler-config: pooling_type {kind!r} is not supported "
                             f"(infer pools: {', '.join(ENCODER_SUPPORTED)}; a decoder "
                             f"{', '.join(SUPPORTED)})")  # fmt: skip
        data["pooling_type"] = kind.upper()
    if "normalize" in data and not isinstance(data["normalize"], bool):
        raise ValueError(f"--pooler-config: normalize must be true or false, "
                         f"got {data['normalize']!r}")  # fmt: skip
    return data


def load_pooler_config(
    model_dir: Path, override: dict[str, Any] | None = None, encoder: bool = False
) -> PoolerConfig:
    """The model folder's pooling (its ``modules.json``), with ``override`` over it
    (``encoder``: a bidirectional encoder's, which pools more ways). A model whose files infer
    cannot follow (another pooling, a module it does not run, an unreadable file) is still
    served for generation, its embedding requests refused naming the problem (``problem``).
    An override's ``pooling_type`` replaces what the files say (the projections after it stay;
    a module infer cannot run is set aside); one this model cannot pool by is a
    ``ValueError``."""
    override = override or {}
    supported = ENCODER_SUPPORTED if encoder else SUPPORTED
    config = PoolerConfig(pooling_type=supported[0])
    modules_path = Path(model_dir) / "modules.json"
    late = load_late_interaction(Path(model_dir)) if encoder else None
    stanford = _stanford_colbert(Path(model_dir)) if encoder else None
    if stanford is not None:  # (its projection in its own checkpoint; settings beside it)
        late = stanford[0]
        config = PoolerConfig("CLS", True, str(Path(model_dir) / "artifact.metadata"),
                              dense=(stanford[1],))  # fmt: skip
    elif modules_path.is_file():
        config = _from_sentence_transformers(modules_path, "pooling_type" not in override,
                                             supported)  # fmt: skip
    elif encoder and _emb_pooler(Path(model_dir)) == "mean":  # (Jina BERT's own config)
        config = PoolerConfig("MEAN", source=f"{Path(model_dir) / 'config.json'} emb_pooler")
    if late is not None:  # (its every token's vector, normalized as PyLate encodes)
        config = replace(config, normalize=True, late_interaction=late)
    if encoder and late is None:  # (BGE-M3's multi-vector projection and sparse weights)
        try:
            multi = _bge_m3_linear(Path(model_dir), "colbert_linear.pt")
        except ModelLoadError as e:  # (its dense embeddings need no such file)
            config = replace(config, tokens_problem=str(e))
        else:
            if multi is not None:
                config = replace(config, token_dense=(multi,), token_first=1)
        try:
            config = replace(config, sparse=_bge_m3_linear(Path(model_dir), "sparse_linear.pt",
                                                           out_features=1))  # fmt: skip
        except ModelLoadError as e:
            config = replace(config, sparse_problem=str(e))
    if override:
        kind = override.get("pooling_type", config.pooling_type)
        if "pooling_type" in override and kind not in supported:
            raise ValueError(f"--pooler-config: pooling_type {kind!r} is not supported for "
                             f"this model (a {'n encoder' if encoder else ' decoder'}: it pools "
                             f"by {', '.join(supported)})")  # fmt: skip
        config = replace(
            config,
            pooling_type=kind,
            normalize=override.get("normalize", config.normalize),
            source=f"--pooler-config over {config.source}",
            problem=None if "pooling_type" in override else config.problem,
            # (a ColBERT's refused projection stays refused: its vectors are the projection's)
            tokens_problem=None
            if "pooling_type" in override and config.late_interaction is None
            else config.tokens_problem,
        )
    return config


def _stanford_colbert(model_dir: Path) -> tuple[LateInteraction, DenseLayer] | None:
    """A ColBERT folder as Stanford's library saves it (``architectures: HF_ColBERT``): its
    settings from ``artifact.metadata`` (``query_token_id``, ``doc_token_id``,
    ``query_maxlen``, ``doc_maxlen``, ``attend_to_mask_tokens``; PyLate's reading, its
    defaults where absent: prefixes ``[unused0]`` / ``[unused1]``) and its checkpoint's
    ``linear.weight`` as a bias-free Dense layer; None for any other folder."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or (config.get("architectures") or [None])[0] != "HF_ColBERT":
        return None
    path = model_dir / "artifact.metadata"
    meta: dict[str, Any] = {}
    if path.is_file():
        try:
            meta = json.loads(path.read_text())
        except ValueError as e:
            raise ModelLoadError(f"{path} cannot be read: {e}") from None
    late = LateInteraction(
        query_prefix=str(meta.get("query_token_id") or "[unused0]"),
        document_prefix=str(meta.get("doc_token_id") or "[unused1]"),
        attend_to_expansion=bool(meta.get("attend_to_mask_tokens", False)),
    )
    late = replace(late, **{
        field: _setting(path, key, meta[key], int)
        for key, field in (("query_maxlen", "query_length"), ("doc_maxlen", "document_length"))
        if meta.get(key) is not None
    })  # fmt: skip
    shape = _tensor_shape(model_dir / "model.safetensors", "linear.weight")
    if shape is None or len(shape) != 2:
        raise ModelLoadError(f"{model_dir}: an HF_ColBERT checkpoint without a 2-D linear.weight "
                             "(its projection) in model.safetensors")  # fmt: skip
    return late, DenseLayer(model_dir, shape[1], shape[0], False, "identity")


def _bge_m3_linear(model_dir: Path, name: str, out_features: int | None = None
                   ) -> DenseLayer | None:  # fmt: skip
    """One of BGE-M3's layers beside its encoder, a ``Linear``'s ``weight`` and ``bias`` as
    FlagEmbedding's ``BGEM3FlagModel`` saves them: ``colbert_linear.pt`` (its multi-vector
    projection, ``hidden -> hidden``, applied to every token's state but the first) or
    ``sparse_linear.pt`` (``hidden -> 1``: each token's lexical weight, ``out_features``);
    None where the folder has no such file."""
    path = model_dir / name
    if not path.is_file():
        return None
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        rows, cols = state["weight"].shape
    except Exception as e:  # noqa: BLE001 - torch.load raises many types
        raise ModelLoadError(f"{path} is not a Linear layer's state ({e})") from None
    if out_features is not None and rows != out_features:
        raise ModelLoadError(f"{path}: a Linear layer to {rows} values, not {out_features}")
    return DenseLayer(model_dir, int(cols), int(rows), "bias" in state, "identity",
                      file=path.name, prefix="")  # fmt: skip


def _tensor_shape(file: Path, name: str) -> list[int] | None:
    """The shape of tensor ``name`` in safetensors ``file`` (read from its header: no data),
    None where the file or the tensor is missing."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="numpy") as f:
            return list(f.get_slice(name).get_shape()) if name in f.keys() else None  # noqa: SIM118
    except (OSError, SafetensorError):
        return None


def load_late_interaction(model_dir: Path) -> LateInteraction | None:
    """A PyLate ColBERT folder's query and document encoding (its
    ``config_sentence_transformers.json`` says ``model_type: ColBERT`` or ``similarity_fn_name:
    MaxSim``; PyLate's defaults where a key is absent), None for any other folder. An
    unreadable value is a :class:`ModelLoadError` naming it."""
    import json

    path = model_dir / "config_sentence_transformers.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not (
        data.get("model_type") == "ColBERT" or data.get("similarity_fn_name") == "MaxSim"
    ):
        return None
    values = {field: _setting(path, key, data[key], kind)
              for key, (field, kind) in _PYLATE_SETTINGS.items() if data.get(key) is not None}  # fmt: skip
    words = data.get("skiplist_words")
    if words is not None and not (
        isinstance(words, list) and all(isinstance(w, str) for w in words)
    ):
        raise ModelLoadError(f"{path}: skiplist_words is not a list of strings")
    if words is not None:
        values["skiplist_words"] = tuple(words)
    return replace(LateInteraction(), **values)


# PyLate's config keys -> the LateInteraction field each sets, and its type
_PYLATE_SETTINGS = {
    "query_prefix": ("query_prefix", str),
    "document_prefix": ("document_prefix", str),
    "query_length": ("query_length", int),
    "document_length": ("document_length", int),
    "do_query_expansion": ("query_expansion", bool),
    "attend_to_expansion_tokens": ("attend_to_expansion", bool),
}


def _setting(path: Path, key: str, value: Any, kind: type) -> Any:
    """A ColBERT setting ``key`` of the file ``path``, checked as ``kind`` (a length: an integer
    of 2 or more, room for a prefix and a token); a :class:`ModelLoadError` naming it else."""
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
        raise ModelLoadError(f"{path}: {key} {value!r} is not an integer of 2 or more")
    if not isinstance(value, kind):
        raise ModelLoadError(f"{path}: {key} {value!r} is not a {kind.__name__}")
    return value


def _emb_pooler(model_dir: Path) -> str | None:
    """``emb_pooler`` of the model's ``config.json`` (Jina BERT's: how its own ``encode``
    pools), None where it has none or cannot be read."""
    import json

    try:
        value = json.loads((model_dir / "config.json").read_text()).get("emb_pooler")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _from_sentence_transformers(
    modules_path: Path, read_pooling: bool, supported: tuple[str, ...]
) -> PoolerConfig:
    """What ``modules.json`` (and its Pooling module's config, with ``read_pooling``) say."""
    import json

    source = str(modules_path)
    try:
        modules = json.loads(modules_path.read_text())
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ValueError("expected a list of module objects")
    except (ValueError, UnicodeDecodeError) as e:
        problem = f"{modules_path} cannot be read: {e}"
        return PoolerConfig(source=source, problem=problem, tokens_problem=problem)
    types = [m.get("type") for m in modules]
    normalize = _NORMALIZE_MODULE in types
    others = [t for t in types if t not in _KNOWN_MODULES]
    if others and read_pooling:
        problem = (f"its sentence-transformers pipeline ({modules_path}) has "
                   f"{', '.join(map(str, others))}, which infer does not run")  # fmt: skip
        return PoolerConfig(normalize=normalize, source=source, problem=problem,
                            tokens_problem=problem)  # fmt: skip
    dense, problem = _dense_layers(modules_path.parent, modules, types)
    if problem is not None:
        return PoolerConfig(normalize=normalize, source=source, problem=problem,
                            tokens_problem=problem)  # fmt: skip
    pooling_type = supported[0]
    if _POOLING_MODULE in types and read_pooling:
        path = modules_path.parent / str(modules[types.index(_POOLING_MODULE)].get("path", ""))
        # (a Dense module after several modes takes them side by side, not a token's state:
        # here, token embeddings are refused with the pooling)
        try:
            pooling = read_json(path / "config.json", "the sentence-transformers pooling config")
        except ModelLoadError as e:
            return PoolerConfig(normalize=normalize, source=source, problem=str(e),
                                tokens_problem=str(e))  # fmt: skip
        chosen = [name for key, name in MODES.items() if pooling.get(key)]
        if len(chosen) != 1:
            problem = f"{path / 'config.json'} pools by {' + '.join(chosen) or 'no mode'}"
            return PoolerConfig("+".join(chosen) or "NONE", normalize, source, problem,
                                tokens_problem=problem)  # fmt: skip
        pooling_type = chosen[0]
    problem = None
    if pooling_type not in supported:
        problem = f"this model pools by {pooling_type} ({source})"
    return PoolerConfig(pooling_type, normalize, source, problem, dense)


def _dense_layers(
    folder: Path, modules: list[dict[str, Any]], types: list[Any]
) -> tuple[tuple[DenseLayer, ...], str | None]:
    """The ``Dense`` modules of ``modules.json`` (each after the pooling and before the
    normalization, as sentence-transformers runs them), or why infer cannot run them."""
    at = [i for i, t in enumerate(types) if t in _DENSE_MODULES]
    if not at:
        return (), None
    after = types.index(_POOLING_MODULE) if _POOLING_MODULE in types else -1
    before = types.index(_NORMALIZE_MODULE) if _NORMALIZE_MODULE in types else len(types)
    if not all(after < i < before for i in at):
        return (), "its Dense modules are not between its Pooling and Normalize modules"
    layers = []
    for i in at:
        path = folder / str(modules[i].get("path", ""))
        try:
            config = read_json(path / "config.json", "a sentence-transformers Dense config")
            act = config.get("activation_function", "torch.nn.modules.activation.Tanh")
            if config.get("use_residual"):
                return (), (f"its Dense module {path.name} adds its input back (use_residual), "
                            "which infer does not run")  # fmt: skip
            if act not in DENSE_ACTIVATIONS:
                return (), (f"its Dense module {path.name} has activation {act}, which infer "
                            f"does not run ({', '.join(sorted(DENSE_ACTIVATIONS))})")  # fmt: skip
            layers.append(DenseLayer(path, int(config["in_features"]),
                                     int(config["out_features"]), bool(config.get("bias", True)),
                                     DENSE_ACTIVATIONS[act]))  # fmt: skip
        except (ModelLoadError, KeyError, TypeError, ValueError) as e:
            return (), f"its Dense module {path} cannot be read: {e}"
    for a, b in zip(layers, layers[1:], strict=False):
        if a.out_features != b.in_features:
            return (), (f"its Dense module {b.path.name} takes {b.in_features} values, "
                        f"{a.path.name} gives {a.out_features}")  # fmt: skip
    return tuple(layers), None


def write_pooling_files(
    folder: Path, pooling_type: str, normalize: bool = True, dense: tuple[str, ...] = ()
) -> None:
    """The sentence-transformers files saying ``pooling_type`` (a name of :data:`MODES`:
    ``LAST``, ``MEAN``, ``CLS``, ...), then the ``Dense`` modules in the sub-folders named by
    ``dense`` (their files already there) and, with ``normalize``, a ``Normalize`` module: what
    :func:`load_pooler_config` reads (a GGUF embedding file's folder, test models)."""
    import json

    folder = Path(folder)
    modules = [{"path": "", "type": _TRANSFORMER_MODULE},
               {"path": "1_Pooling", "type": _POOLING_MODULE}]  # fmt: skip
    modules += [{"path": path, "type": _DENSE_MODULE} for path in dense]
    if normalize:
        modules.append({"path": f"{len(modules)}_Normalize", "type": _NORMALIZE_MODULE})
    modules = [{"idx": i, "name": str(i)} | m for i, m in enumerate(modules)]
    (folder / "modules.json").write_text(json.dumps(modules, indent=1) + "\n")
    (folder / "1_Pooling").mkdir(exist_ok=True)
    config = {key: name == pooling_type for key, name in MODES.items()}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=1) + "\n")
