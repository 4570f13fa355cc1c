"""GPT-2 in Equinox + jaxstate, from Hugging Face's weights: greedy decoding with a
KV cache held in state.

The decoder's blocks are built at once by `eqx.filter_vmap` (every array, and every
block's KV cache, has a leading layer axis) and run one after another by
`jaxstate.scan`, which hands each iteration its block's slice of the caches to
append to, in place. Attention is GPT-2's: one fused query/key/value projection
(`c_attn`), over a `jaxstate.nn.KVCache`.

The weights come from a Hugging Face GPT-2 checkpoint on disk (`model.safetensors`,
or a sharded one's `model.safetensors.index.json`, with its `config.json` beside
it), loaded by `jaxstate.load(..., layout="torch")`: Hugging Face's per-layer names
(`transformer.h.3.ln_1.weight`) go into the stack (`h.ln_1.weight`, layer 3), and
GPT-2's `Conv1D` weights, stored `(in, out)`, are transposed for `eqx.nn.Linear`.
Without `--weights`, a small GPT-2 with random weights.

    python examples/gpt2.py
    python examples/gpt2.py --weights gpt2/model.safetensors --prompt-ids 464 3290
    # with the `tokenizers` package and gpt2/tokenizer.json:
    python examples/gpt2.py --weights gpt2/model.safetensors --prompt "Hello, I'm"

(`huggingface-cli download gpt2 model.safetensors config.json tokenizer.json
--local-dir gpt2` fetches the files.)
"""

import argparse
import dataclasses
import json
import math
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

import jaxstate


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of Hugging Face's `GPT2Config` that the model needs."""

    vocab_size: int = 256
    n_positions: int = 128
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5

    @classmethod
    def from_json(cls, path: str | pathlib.Path) -> "Config":
        """A Hugging Face `config.json`."""
        saved = json.loads(pathlib.Path(path).read_text())
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in fields})


#
# The model
#


class Attention(eqx.Module):
    """GPT-2's causal self-attention: a fused projection to queries, keys and
    values, a KV cache, an output projection."""

    c_attn: eqx.nn.Linear  # (3 * n_embd, n_embd): queries, keys, values
    c_proj: eqx.nn.Linear
    cache: jaxstate.nn.KVCache
    n_head: int = eqx.field(static=True)

    def __init__(self, config: Config, max_len: int, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        d = config.n_embd
        self.c_attn = eqx.nn.Linear(d, 3 * d, key=k1)
        self.c_proj = eqx.nn.Linear(d, d, key=k2)
        self.cache = jaxstate.nn.KVCache(max_len, config.n_head, d // config.n_head)
        self.n_head = config.n_head

    def __call__(self, x: Float[Array, "n d"], use_cache: bool) -> Float[Array, "n d"]:
        n, d = x.shape
        qkv = jax.vmap(self.c_attn)(x)
        q, k, v = (t.reshape(n, self.n_head, -1) for t in jnp.split(qkv, 3, axis=-1))
        if use_cache:
            # The new tokens' keys and values go into this layer's cache, in place;
            # token i (at position start + i) attends to positions up to its own.
            k, v, start, _ = self.cache.append(k, v)
            positions = jnp.arange(self.cache.max_len)
            mask = positions[None, :] <= start + jnp.arange(n)[:, None]
        else:
            mask = jnp.tril(jnp.ones((n, n), bool))
        logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("hqk,khd->qhd", weights, v).reshape(n, d)
        return jax.vmap(self.c_proj)(out)


class MLP(eqx.Module):
    c_fc: eqx.nn.Linear
    c_proj: eqx.nn.Linear

    def __init__(self, config: Config, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.c_fc = eqx.nn.Linear(config.n_embd, 4 * config.n_embd, key=k1)
        self.c_proj = eqx.nn.Linear(4 * config.n_embd, config.n_embd, key=k2)

    def __call__(self, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        h = jax.nn.gelu(jax.vmap(self.c_fc)(x), approximate=True)  # "gelu_new"
        return jax.vmap(self.c_proj)(h)


class Block(eqx.Module):
    ln_1: eqx.nn.LayerNorm
    attn: Attention
    ln_2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, config: Config, max_len: int, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        eps = config.layer_norm_epsilon
        self.ln_1 = eqx.nn.LayerNorm(config.n_embd, eps=eps)
        self.attn = Attention(config, max_len, k1)
        self.ln_2 = eqx.nn.LayerNorm(config.n_embd, eps=eps)
        self.mlp = MLP(config, k2)

    def __call__(self, x: Float[Array, "n d"], use_cache: bool) -> Float[Array, "n d"]:
        x = x + self.attn(jax.vmap(self.ln_1)(x), use_cache)
        return x + self.mlp(jax.vmap(self.ln_2)(x))


class GPT2(eqx.Module):
    """Hugging Face's `GPT2LMHeadModel`, with its field names (so that its
    checkpoints load by name): `h` is the stack of blocks, one per layer along
    every array's first axis; the output projection is `wte`'s, transposed."""

    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    h: Block
    ln_f: eqx.nn.LayerNorm

    def __init__(self, config: Config, key: PRNGKeyArray, max_len: int | None = None):
        """`max_len`: the longest sequence the caches hold (`n_positions`)."""
        max_len = config.n_positions if max_len is None else max_len
        k1, k2, k3 = jax.random.split(key, 3)
        self.wte = eqx.nn.Embedding(config.vocab_size, config.n_embd, key=k1)
        self.wpe = eqx.nn.Embedding(config.n_positions, config.n_embd, key=k2)
        keys = jax.random.split(k3, config.n_layer)
        self.h = eqx.filter_vmap(lambda k: Block(config, max_len, k))(keys)
        self.ln_f = eqx.nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def __call__(
        self, tokens: Int[Array, " n"], use_cache: bool = False
    ) -> Float[Array, "n vocab"]:
        """Logits for each of `tokens`. With `use_cache`, `tokens` continue the
        sequence in the caches (a prompt, or the next token)."""
        start = self.cache_length() if use_cache else 0
        positions = start + jnp.arange(tokens.shape[0])
        x = self.wte.weight[tokens] + self.wpe.weight[positions]
        x, _ = jaxstate.scan(lambda x, block: (block(x, use_cache), None), x, self.h)
        return jax.vmap(self.ln_f)(x) @ self.wte.weight.T

    def cache_length(self) -> Int[Array, ""]:
        """How many tokens the caches hold. Outside the scan the stacked caches are
        one state, one length per layer, all equal: the first's."""
        return self.h.attn.cache.length()[0]


#
# Hugging Face's weights
#

# GPT-2's `Conv1D` layers keep their weights as (in, out); `eqx.nn.Linear` as
# (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight")
_CONV1D += ("mlp.c_proj.weight",)


def hf_name(name: str) -> str | None:
    """The model's name, in PyTorch's spelling, of an entry of a Hugging Face
    GPT-2 checkpoint, or `None` for the entries it does not need: the tied
    `lm_head.weight`, and the attention masks older checkpoints hold."""
    if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
        return None
    return name.removeprefix("transformer.")


def from_conv1d(name: str, value):
    """`convert=`: called with each layer's entry on its own (`h[3].attn...`)."""
    return np.asarray(value).T if name.endswith(_CONV1D) else value


def load_hf(path: str | pathlib.Path, config: Config, max_len: int | None = None):
    """A `GPT2` holding the weights of a Hugging Face checkpoint: a `.safetensors`
    file, or a sharded checkpoint's `.index.json`."""
    like = eqx.filter_eval_shape(GPT2, config, jax.random.key(0), max_len)
    return jaxstate.load(
        path, like, layout="torch", rename=hf_name, convert=from_conv1d
    )


def hf_state_dict(model: GPT2) -> dict:
    """The model's weights under Hugging Face's names and layouts, as
    `GPT2LMHeadModel.load_state_dict` takes them (with `strict=True`)."""
    weights = jaxstate.state_dict(model, per_layer="h", layout="torch")
    out = {}
    for name, value in weights.items():
        value = np.asarray(value)
        out["transformer." + name] = value.T if name.endswith(_CONV1D) else value
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


#
# Decoding
#


@jaxstate.jit
def step(model: GPT2, tokens: Int[Array, " n"]) -> Float[Array, "n vocab"]:
    """Appends `tokens` to the cached sequence; returns their logits."""
    return model(tokens, use_cache=True)


def generate(model: GPT2, prompt, n_new: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding: the `n_new` tokens after `prompt`, and the prompt's
    logits. Empties the caches first."""
    jaxstate.reset(model, "cache")
    logits = step(model, jnp.asarray(prompt, jnp.int32))
    prompt_logits = np.asarray(logits)
    tokens = [int(jnp.argmax(logits[-1]))]
    for _ in range(n_new - 1):
        logits = step(model, jnp.asarray(tokens[-1:], jnp.int32))
        tokens.append(int(jnp.argmax(logits[-1])))
    return tokens, prompt_logits


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", help="a .safetensors file, or a shards' index")
    parser.add_argument("--config", help="config.json (default: beside --weights)")
    parser.add_argument("--prompt-ids", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--prompt", help="text (needs `tokenizers`, tokenizer.json)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=None, help="of the caches")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    tokenizer = None
    if args.weights is None:
        config = Config() if args.config is None else Config.from_json(args.config)
        model = GPT2(config, jax.random.key(args.seed), args.max_len)
        print(f"random weights: {config}")
    else:
        weights = pathlib.Path(args.weights)
        config = Config.from_json(args.config or weights.parent / "config.json")
        model = load_hf(weights, config, args.max_len)
        print(f"weights from {weights}: {config}")
        if args.prompt is not None:
            import tokenizers  # optional, for text prompts only

            path = weights.parent / "tokenizer.json"
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
    prompt = args.prompt_ids
    if tokenizer is not None:
        prompt = tokenizer.encode(args.prompt).ids
    max_len = model.h.attn.cache.max_len
    if len(prompt) + args.new_tokens > max_len:
        parser.error(f"the prompt and the new tokens must fit in {max_len}")

    generate(model, prompt, 2)  # compiles both steps
    start = time.perf_counter()
    tokens, logits = generate(model, prompt, args.new_tokens)
    elapsed = time.perf_counter() - start
    print(f"prompt: {prompt}")
    print(f"greedy: {tokens}")
    if tokenizer is not None:
        print(repr(tokenizer.decode(prompt + tokens)))
    print(f"{args.new_tokens / elapsed:.0f} tokens/s (prompt included in the time)")
    return {"model": model, "prompt": prompt, "tokens": tokens, "logits": logits}


if __name__ == "__main__":
    main()
