"""Proof of fsdp-tied-embedding-grad: under Megatron-FSDP with gradient accumulation fusion, the
weight an embedding shares with the output layer (``share_embeddings_and_output_weights``, the
GPT default) gets the gradient of both of its uses.

LanguageModule marks the shared weight ``zero_out_wgrad``: the output layer's fused wgrad goes
into ``main_grad`` and its autograd gradient is a zero dummy, to which autograd adds the
embedding lookup's gradient in ``param.grad``. DDP adds that ``param.grad`` into ``main_grad``;
Megatron-FSDP deleted it (``grad_added_to_main_grad`` set), so the step lost the embedding's
contribution, in every sharding strategy and from the first microbatch on. Megatron-FSDP now adds
it, as DDP does.

Real MCore: a LanguageModule (its own tying, ``setup_embeddings_and_output_layer``) with a
VocabParallelEmbedding and a ColumnParallelLinear output layer taking the shared weight, under
FullyShardedDataParallel (Megatron-FSDP v1) with gradient accumulation fusion, in forked gloo
worlds of 1 and 2 ranks, every sharding strategy; stand-ins: those of
tests/proofs/_megatron_fsdp_v1.py (CPU placement, a TE-style fused-wgrad linear in the block),
whose ``train_step`` drives this model in place of its own. Not here: 0.14 and 0.15, where such a
model fails its first backward pass instead (the manifest says why).
"""

from __future__ import annotations

import _megatron_fsdp_v1
import pytest
import torch
from _megatron_fsdp_v1 import (
    HIDDEN,
    NUM_MICROBATCHES,
    SOUND,
    STRATEGIES,
    TOLERANCE,
    VOCAB,
    Block,
    dp_world,
    train_step,
)
from _support import check

TIED = "embedding.word_embeddings.weight"


def tied_lm(config, uses: int = 1) -> torch.nn.Module:
    """A GPT-shaped LanguageModule: embedding, one FSDP unit, an output layer that takes the
    embedding's weight (``share_embeddings_and_output_weights``)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

    class Embedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = VocabParallelEmbedding(
                VOCAB, HIDDEN, init_method=torch.nn.init.normal_, config=config
            )

    class TiedLM(LanguageModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.pre_process = self.post_process = True
            self.share_embeddings_and_output_weights = True
            self.embedding = Embedding()
            self.block = Block(config.gradient_accumulation_fusion)
            self.output_layer = ColumnParallelLinear(
                HIDDEN,
                VOCAB,
                config=config,
                init_method=torch.nn.init.normal_,
                bias=False,
                skip_weight_param_allocation=True,
            )
            self.setup_embeddings_and_output_layer()

        def forward(self, x):
            # train_step's microbatches are hidden states: each value picks a token.
            tokens = (x.detach().flatten() * VOCAB).floor().long().remainder(VOCAB)
            hidden = self.block(self.embedding.word_embeddings(tokens))
            return self.output_layer(hidden, weight=self.shared_embedding_or_output_weight())[0]

    return TiedLM()


def tied_case(strategy: str, overlap_grad_reduce: bool):
    def case() -> None:
        _megatron_fsdp_v1.Net = tied_lm  # in this forked rank only
        errors = train_step(strategy, overlap_grad_reduce)
        if not errors[SOUND] < TOLERANCE:
            print(f"not judged: {strategy} gets {SOUND} wrong ({errors[SOUND]:.3g})")
            return
        assert errors[TIED] < TOLERANCE, (
            f"{strategy}, overlap_grad_reduce={overlap_grad_reduce}: relative error of the tied "
            f"weight's gradient over {NUM_MICROBATCHES} microbatches {errors[TIED]:.3g}"
        )

    return case


# One case per strategy: the gradient is lost the same way with and without overlapped reduction.
CASES = {
    f"{s}-overlap{int(o)}": tied_case(s, o)
    for s, o in STRATEGIES
    if (s, o) not in (("no_shard", True), ("optim", False))
}


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def world(request, tmp_path_factory):
    # Imported once here, not in every rank after the fork (a config imports more on first use).
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter  # noqa: F401
    import megatron.core.models.common.language_module.language_module  # noqa: F401
    from megatron.core.transformer import TransformerConfig

    TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1)

    return dp_world(request.param, CASES, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_tied_embedding_grad(world, case):
    check(world, case)
