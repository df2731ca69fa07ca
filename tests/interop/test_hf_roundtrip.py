"""Continue pretraining a Hugging Face model: import at tp2 x pp2 x dp2, train, export, load in transformers.

transformers builds a random LlamaForCausalLM (grouped-query, untied) and a GPT2LMHeadModel (tied) from configs
and saves them locally (nothing is downloaded). Their weights are drawn 10x wider than usual (std 0.2), so the
first loss (~11 rather than log V) depends on every mapping: a wrong rotary layout moves it by far more than
the tolerance, where at std 0.02 every model's loss is log V to 1e-5. megazero starts a run from each folder (train.init_from) at
tp 2 (sequence parallel) x pp 2 x dp 2 with ZeRO-1, trains 5 steps and saves; megazero.interop.export writes the last
checkpoint as a Hugging Face folder, which transformers loads.

Tolerances: the first step's loss is the imported weights' loss on the first global batch, computed by the
same fp32 operations up to the order of sums over tp shards, microbatches and dp ranks, so 1e-5 relative (the
DESIGN's parity bound); the exported model's logits go through a save and a load of the same fp32 values,
1e-4 as tests/interop/test_export.py.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import transformers  # noqa: E402

from megazero.checkpoint.store import read_model_state  # noqa: E402
from megazero.config.load import load_config  # noqa: E402
from megazero.data import build_data  # noqa: E402
from megazero.interop.export import export  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.interop.roundtrip_runs import CONFIG, KEYS, SEQ, STEPS, VOCAB, overrides, train  # noqa: E402
from tests.runs import read_metrics, write_corpus  # noqa: E402

MODELS = {  # what transformers builds; megazero's keys for each are roundtrip_runs.KEYS
    "llama": transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2),
    "gpt2": transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2),
}
assert set(MODELS) == set(KEYS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    text, cache = write_corpus(base / "text"), base / "cache"
    _tokenizer_json(text, base / "tokenizer.json")
    for name, hf_config in MODELS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        with torch.no_grad():  # norm weights 1 and biases 0 would hide a dropped or swapped mapping
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(base / f"hf_{name}")
    run_ranks(8, train, text, cache, base)
    return base, text, cache


def _tokenizer_json(text, path) -> None:
    """The model's own tokenizer, as a Hugging Face folder ships it: a byte-level BPE of 500 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in sorted(text.iterdir())], trainer)
    tok.save(str(path))


def _hf(folder) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_imported_model_trains_and_exports(runs, name, tmp_path):
    base, text, cache = runs
    cfg = load_config(CONFIG, overrides(text, cache, base, name))
    data = build_data(cfg.data, VOCAB, SEQ, cfg.train.seed, is_builder=False, barrier=lambda: None)
    batch = torch.cat(data.train_microbatches(0, 0, 1, cfg.train.micro_batch, cfg.train.global_batch))
    with torch.no_grad():
        logits = _hf(base / f"hf_{name}")(input_ids=batch[:, :-1]).logits
    want = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).item()
    losses = [r["loss"] for r in read_metrics(base / name) if "loss" in r]
    print(f"{name}: megazero step-1 loss {losses[0]:.7f}, transformers {want:.7f}, rel {abs(losses[0] - want) / want:.2e}")
    assert len(losses) == STEPS and abs(losses[0] - want) <= 1e-5 * want, (losses, want)

    ckpt = base / name / "checkpoints" / f"step_{STEPS:08d}"
    out = export(ckpt, tmp_path / "export")
    ours = build_gpt(cfg.model, 0).eval()
    state = read_model_state(ckpt)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(state[n])
        ids = batch[:2, :-1]
        got = _hf(out)(input_ids=ids).logits
        mine = ours(ids)[..., :VOCAB]
        imported = _hf(base / f"hf_{name}")(input_ids=ids).logits
    print(f"{name}: export logits max diff {(got - mine).abs().max().item():.2e}")
    assert (got - mine).abs().max().item() <= 1e-4, (got - mine).abs().max().item()
    assert (got - imported).abs().max().item() > 1e-3  # the export holds the trained weights, not the import's
    # the run's tokenizer.json went with it: transformers encodes as the run did
    from megazero.data.tokenizer import Tokenizer

    text = "def main():\n    return 42  # the answer"
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == \
        Tokenizer.load(base / "tokenizer.json").encode(text)
