"""A tiny Llama whose output depends on its context, made once and cached, and prompts for it.

vLLM's ``--load-format dummy`` gives a uniform output distribution that ignores the context, so a test
that checks "D's output equals one engine's" would pass with broken KV. This module writes a real (if
meaningless) model instead: a 2-layer Llama with seeded random weights (normal, std ``initializer_range``)
as safetensors, its ``config.json`` and ``generation_config.json``, and a WordLevel tokenizer written with
the ``tokenizers`` library (``tokenizer.json`` + ``tokenizer_config.json``), all in one directory that vLLM
loads with ``--model DIR --tokenizer DIR``. The directory is ``.cache/tiny-llama/<hash of the params>``;
it is written atomically (a temporary directory renamed into place), so concurrent callers are safe.

Token ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, 3 ``<pad>``, then one word per id, ``w4`` ... ``w1023``.
A text prompt is the words separated by spaces; it tokenizes to exactly those ids (no BOS is added).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVPUSH_CACHE", REPO / ".cache"))
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
FIRST_WORD = len(SPECIAL)
# Bumped when the layout of the written files changes, so old caches are not reused.
FORMAT = 1


@dataclass(frozen=True)
class TinyLlama:
    """The parameters of the tiny model. Every field is part of the cache key."""

    num_hidden_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    initializer_range: float = 0.2
    dtype: str = "float32"
    seed: int = 1234
    # A hybrid model: each layer's attention ("full_attention" or "sliding_attention", HF's
    # ``layer_types``, which vLLM's Llama honours) and the window of the sliding ones in tokens.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    def key(self) -> str:
        # Fields left at None are not part of the key: the plain model keeps its cached directory.
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        blob = json.dumps({"format": FORMAT, **fields}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def hybrid(layers: int = 4, sliding_window: int = 96) -> TinyLlama:
    """The tiny model with alternating full and sliding-window attention layers (full first): vLLM's
    hybrid allocator makes two KV cache groups of it whose tensors alias one allocation."""
    types = tuple("full_attention" if i % 2 == 0 else "sliding_attention" for i in range(layers))
    return TinyLlama(num_hidden_layers=layers, layer_types=types, sliding_window=sliding_window)


def model_dir(params: TinyLlama | None = None, cache: Path | None = None) -> Path:
    """Returns the directory of the tiny model, writing it first if it is not cached yet."""
    params = params or TinyLlama()
    root = Path(cache or CACHE) / "tiny-llama"
    out = root / params.key()
    if (out / ".complete").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{params.key()}-", dir=root))
    try:
        _write_model(params, tmp)
        _write_tokenizer(params, tmp)
        (tmp / "params.json").write_text(json.dumps(asdict(params), indent=1) + "\n")
        (tmp / ".complete").write_text("")
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            tmp.rename(out)
        except OSError:
            # Another process won the race; its copy is identical (same seed, same params).
            if not (out / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_model(p: TinyLlama, out: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    if p.num_attention_heads % p.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    rng = np.random.default_rng(p.seed)
    h, q, kv = p.hidden_size, p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * p.initializer_range).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(p.vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        tensors[pre + "self_attn.q_proj.weight"] = normal(q, h)
        tensors[pre + "self_attn.k_proj.weight"] = normal(kv, h)
        tensors[pre + "self_attn.v_proj.weight"] = normal(kv, h)
        tensors[pre + "self_attn.o_proj.weight"] = normal(h, q)
        tensors[pre + "mlp.gate_proj.weight"] = normal(p.intermediate_size, h)
        tensors[pre + "mlp.up_proj.weight"] = normal(p.intermediate_size, h)
        tensors[pre + "mlp.down_proj.weight"] = normal(h, p.intermediate_size)
        tensors[pre + "input_layernorm.weight"] = np.ones(h, np.float32)
        tensors[pre + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    tensors["lm_head.weight"] = normal(p.vocab_size, h)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "vocab_size": p.vocab_size,
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": p.initializer_range,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": p.dtype,
        "dtype": p.dtype,
        "use_cache": True,
    }
    if p.layer_types is not None:
        if len(p.layer_types) != p.num_hidden_layers:
            raise ValueError(f"{len(p.layer_types)} layer types for {p.num_hidden_layers} layers")
        config["layer_types"] = list(p.layer_types)
        config["sliding_window"] = p.sliding_window
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")


def _write_tokenizer(p: TinyLlama, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({word(i): i for i in range(FIRST_WORD, p.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Word pieces are whole words: decoding puts a space before each one but the first.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": p.max_position_embeddings,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")


def word(token_id: int) -> str:
    """The word of a (non-special) token id."""
    return f"w{token_id}"


def ids_to_text(ids: list[int]) -> str:
    """The text prompt that tokenizes to exactly ``ids`` (ids must not be special)."""
    if any(i < FIRST_WORD for i in ids):
        raise ValueError("special token ids have no word")
    return " ".join(word(i) for i in ids)


def make_prompts(
    lengths: list[int], seed: int = 0, vocab_size: int = TinyLlama.vocab_size
) -> list[list[int]]:
    """``len(lengths)`` deterministic prompts of token ids, prompt ``i`` of ``lengths[i]`` tokens.

    The ids are uniform over the non-special vocabulary, seeded by ``seed`` and the prompt's index, so two
    prompts share no long prefix (prefix caching cannot stand in for a transfer).
    """
    prompts = []
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"prompt {i}: length {n} < 1")
        rng = random.Random(f"kvpush-prompt-{seed}-{i}")
        prompts.append([rng.randrange(FIRST_WORD, vocab_size) for _ in range(n)])
    return prompts


def spread_lengths(n: int, low: int = 30, high: int = 900) -> list[int]:
    """``n`` prompt lengths spread evenly from ``low`` to ``high`` tokens (both included)."""
    if n == 1:
        return [low]
    return [round(low + (high - low) * i / (n - 1)) for i in range(n)]


if __name__ == "__main__":
    print(model_dir())
