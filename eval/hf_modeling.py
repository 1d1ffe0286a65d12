"""Hugging Face transformers classes around the smlp core `LanguageModel`.

This is the modeling file of a folder written by `smlp-export` (smlp_eval.hf_export): the exporter
copies it into the folder as `modeling_smlp.py`, with the block between the `smlp-export: core`
markers replaced by the core's own sources (smlp_eval.hf_core_bundle), so the folder runs the very
layers of `smlp/` and needs only torch and transformers. In this repository the block imports the
installed core instead, so the classes can be tested as they are.

    SMLPConfig        config.json: `lm_config` holds every field of the core's LMConfig (family, widths,
                      layers, routers, ...); vocab_size, hidden_size, num_hidden_layers and
                      max_position_embeddings are read from it. `routing_prefix` = P, the positions
                      a partial-prediction sMLP routes on (sMLP sec. 3.2.2; 0 for every other model),
                      and `routing_prefix_fill`, the P tokens smlp-generate puts before short prompts.
    SMLPForCausalLM   AutoModelForCausalLM: logits of the core's forward; `generate()` decodes with
                      the core's cache (smlp/decoding_cache.py) through `SMLPCache`.
    SMLPCache         past_key_values: the core's DecodingCache (one position per layer and step).
                      The token-routed gMLP has no per-position step: its cache keeps the tokens and
                      recomputes the prefix, as the fairseq decoder does.

Positions. The spatial weights of the gMLP / sMLP layers are tied to absolute positions (no
sliding window): a sequence holds at most max_position_embeddings (= seq_len) tokens, starts at
position 0 with the </s> every line of the training data starts with, and rows of a batch must be
aligned on position 0. Right padding is fine (the model is causal); left padding is refused.

Partial prediction (routing_prefix = P > 0). Logits at positions < P are not predictions (training
never scored them): score or generate only from positions >= P. `with_routing_prefix(input_ids)`
left-fills a batch whose last position is before P with the end of `routing_prefix_fill` (real text
that ends a line), the rule smlp-generate and smlp-zeroshot use; the loss ignores positions < P.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# <smlp-export: core> (the exported modeling_smlp.py embeds the core's sources here)
from smlp.lm import LanguageModel, LMConfig

# </smlp-export: core>

__all__ = ["SMLPConfig", "SMLPForCausalLM", "SMLPCache"]


class SMLPConfig(PretrainedConfig):
    """An exported smlp language model: the core's LMConfig (`lm_config`) and the routing prefix."""

    model_type = "smlp"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, lm_config: dict | None = None, routing_prefix: int = 0,
                 routing_prefix_fill: list[int] | None = None, **kwargs):
        self.lm_config = dict(lm_config or {})
        self.routing_prefix = int(routing_prefix)
        self.routing_prefix_fill = [int(i) for i in routing_prefix_fill or []]
        super().__init__(**kwargs)

    def core_config(self) -> LMConfig:
        """The core's LMConfig (validated: a bad field raises ValueError naming it)."""
        return LMConfig(**self.lm_config)

    # the standard names transformers and lm-eval read, from the one source of truth
    @property
    def vocab_size(self) -> int:
        return self.lm_config["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.lm_config["d_model"]

    @property
    def num_hidden_layers(self) -> int:
        return self.lm_config["dense_layers"] + self.lm_config["sparse_layers"]

    @property
    def max_position_embeddings(self) -> int:
        return self.lm_config["seq_len"]


class SMLPCache:
    """past_key_values of SMLPForCausalLM: the core's decoding cache (batch first, reorderable)."""

    is_compileable = False

    def __init__(self, model: LanguageModel):
        self.stepwise = model.supports_cached_decoding
        self.state = model.new_cache() if self.stepwise else None
        self.tokens: torch.Tensor | None = None  # (B, t), only for a model without a step

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.stepwise:
            return self.state.length
        return 0 if self.tokens is None else self.tokens.shape[1]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.stepwise:
            self.state.reorder(beam_idx)
        elif self.tokens is not None:
            self.tokens = self.tokens.index_select(0, beam_idx.to(self.tokens.device))

    def feed(self, model: LanguageModel, new_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the new positions (B, k, V) after the cached ones."""
        if self.stepwise:
            return model(new_ids, cache=self.state)
        self.tokens = new_ids if self.tokens is None else torch.cat([self.tokens, new_ids], dim=1)
        return model(self.tokens)[:, -new_ids.shape[1]:]


def _check_mask(attention_mask: torch.Tensor | None, cached: bool) -> None:
    """Only right padding (a causal model never reads it); none while decoding with a cache."""
    if attention_mask is None:
        return
    keep = attention_mask.bool()
    if bool(keep.all()):
        return
    if cached or bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError(
            "this model's spatial weights are tied to absolute positions: every row must start at position 0, so "
            "batches may be padded on the right only (padding_side='right') and generation needs prompts of one "
            "length (an attention_mask of ones); generate prompts of different lengths one at a time")


def _non_persistent_buffers(model: torch.nn.Module):
    for prefix, module in model.named_modules():
        for name in sorted(module._non_persistent_buffers_set):
            if module._buffers.get(name) is not None:
                yield f"{prefix}.{name}" if prefix else name, module._buffers[name]


class SMLPForCausalLM(PreTrainedModel, GenerationMixin):
    """The core LanguageModel as a transformers causal LM (see the module docstring)."""

    config_class = SMLPConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules: list[str] = []

    def __init__(self, config: SMLPConfig):
        super().__init__(config)
        core = config.core_config()
        if config.routing_prefix != core.prediction_start:
            raise ValueError(f"routing_prefix={config.routing_prefix} in config.json, but lm_config gives a routing "
                             f"prefix of {core.prediction_start} positions: the config was edited by hand")
        # transformers builds the model on the meta device and, after loading the weights, gives the
        # buffers that are not saved (non-persistent: e.g. the deterministic sMoE routing map) empty
        # storage for `_init_weights` to fill. Built on the CPU here, their values are kept to put back.
        # (in fp32: some initializers, e.g. orthogonal_, have no half-precision CPU kernel; then cast)
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.device("cpu"):
                self.model = LanguageModel(core).to(dtype)
        finally:
            torch.set_default_dtype(dtype)
        self._derived_buffers = {name: buf.detach().clone() for name, buf in _non_persistent_buffers(self)}
        self.post_init()

    def _init_weights(self, module) -> None:
        """Put back the derived buffers of `module`; the core initializes its own weights, and an
        exported model loads them all."""
        for name, value in self._derived_buffers.items():
            owner, _, attr = name.rpartition(".")
            if self.get_submodule(owner) is module and module._buffers.get(attr) is not None:
                module._buffers[attr] = value.to(module._buffers[attr].device)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the forward makes its own SMLPCache

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        self.model.embed = value

    def get_output_embeddings(self):
        return None  # the output projection is the embedding itself (tied inside the core)

    def with_routing_prefix(self, input_ids: torch.LongTensor) -> torch.LongTensor:
        """input_ids left-filled so that their last position is >= routing_prefix (partial prediction);
        unchanged for other models and long enough prompts. The rows of the batch share one length."""
        P, n = self.config.routing_prefix, input_ids.shape[1]
        need = max(0, P - (n - 1))
        if not need:
            return input_ids
        fill = self.config.routing_prefix_fill
        if len(fill) < need:
            raise ValueError(f"the routing prefix needs {need} fill tokens before these {n}-token prompts but "
                             f"config.routing_prefix_fill has {len(fill)}")
        head = torch.tensor(fill[len(fill) - need:], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([head.expand(input_ids.shape[0], -1), input_ids], dim=1)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: SMLPCache | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, return_dict: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, **unused) -> CausalLMOutputWithPast | tuple:
        """Logits (B, N, V) of input_ids (B, N); with past_key_values (or use_cache=True), of the N
        positions after those in the cache, which is returned as past_key_values.

        labels: the loss is the mean cross-entropy of the predictions made at positions >=
        routing_prefix (labels shifted inside, -100 ignored), as training scored them.
        """
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("SMLPForCausalLM takes input_ids (token ids of the fairseq dictionary), not "
                             "inputs_embeds")
        cached = past_key_values is not None or bool(use_cache)
        _check_mask(attention_mask, cached)
        if past_key_values is not None and not isinstance(past_key_values, SMLPCache):
            raise TypeError(f"past_key_values must be the SMLPCache this model returned, got "
                            f"{type(past_key_values).__name__}")
        if cached:
            cache = past_key_values if past_key_values is not None else SMLPCache(self.model)
            logits = cache.feed(self.model, input_ids)
        else:
            cache, logits = None, self.model(input_ids)
        loss = None
        if labels is not None:
            if cached:
                raise ValueError("labels score a whole sequence: give them without past_key_values and use_cache")
            P = self.config.routing_prefix
            logits_used = logits[:, P:-1].float()
            loss = F.cross_entropy(logits_used.reshape(-1, logits.shape[-1]), labels[:, P + 1:].reshape(-1),
                                   ignore_index=-100)
        if return_dict is False:
            return tuple(x for x in (loss, logits, cache) if x is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
