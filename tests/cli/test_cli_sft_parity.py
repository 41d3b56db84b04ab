"""``mgpu-train data=sft`` against one process: packed conversations trained through the command line by the package's
own model and by a ``transformers`` directory (``model=hf``), at dp2 (uneven answer counts across the data ranks;
:data:`LAYOUTS` also holds tp2 x pp2 x dp2 with sequence parallelism, see :data:`CASES`), each step's loss and gradient norm within 1e-5 of a plain loop over the
same global batches that runs every conversation of a batch alone and divides the summed answer-token loss by the
batch's answer count."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from chat_helpers import make_chat_tokenizer, short_conversations, write_jsonl
from cli_helpers import BIN, read_metric
from forked_cli import run_cli
from helpers import max_abs_diff

from lightning_mgpu.cli.prepare import main as prepare_main
from lightning_mgpu.data.sft import SFTDataModule
from lightning_mgpu.hf.module import HFCausalLM
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.module import LLMModule

SEQ, GLOBAL, MICRO, SEED, STEPS, LR, WARMUP, DECAY, VOCAB = 64, 8, 2, 7, 3, 3e-3, 2, 0.1, 416
OWN = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=VOCAB, max_seq_len=128)
OWN_ARGS = ["model=tiny", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_hidden=64", f"model.vocab_size={VOCAB}", "model.max_seq_len=128"]
LAYOUTS = {"dp2": ["trainer.devices=2", "parallel.zero_stage=1"],
           "3d": ["trainer.devices=8", "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true",
                  "parallel.pipeline_parallel_size=2", "parallel.zero_stage=1"]}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_parity")
    tok = make_chat_tokenizer(root / "tok")
    data = write_jsonl(root / "chat.jsonl", short_conversations(120))
    prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(root / "chat"), str(data), "--workers", "1",
                  "--max-tokens", str(SEQ + 1), "--no-progress"])
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(13)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama", safe_serialization=True)
    return root


def packed_batches(path):
    packed = SFTDataModule(path, seq_len=SEQ, global_batch_size=GLOBAL, micro_batch_size=MICRO, seed=SEED,
                           val_fraction=0.05).splits()[0]
    return packed, [packed.batch(SEED, step, GLOBAL, 0, GLOBAL) for step in range(STEPS)]


def alone(logits_of, tokens: torch.Tensor, labels: torch.Tensor, eod: int) -> torch.Tensor:
    """The batch's answer-token loss with every conversation run alone: summed, over the batch's answer count."""
    total, count = 0.0, 0
    for ids, lab in zip(tokens, labels):
        inputs, targets = ids[:-1], lab[1:]
        ends = (inputs == eod).nonzero().flatten().tolist()
        for lo, hi in zip([0] + [e + 1 for e in ends], ends + [len(inputs)]):
            wanted = targets[lo:hi].masked_fill(inputs[lo:hi] == eod, -100)
            if hi <= lo or (wanted == -100).all():
                continue
            total = total + F.cross_entropy(logits_of(inputs[lo:hi][None])[0], wanted, reduction="sum")
            count += int((wanted != -100).sum())
    return total / count


def one_process(model: str, root) -> dict:
    """The module's own optimizer and schedule (AdamW, warm-up and cosine), the loss written here."""
    packed, batches = packed_batches(root / "chat")
    eod = packed.pad_id
    if model == "hf":
        module = HFCausalLM(str(root / "llama"), lr=LR, weight_decay=DECAY, warmup_steps=WARMUP, max_steps=STEPS,
                            eod_token_id=eod)
        module.configure_model()
        logits_of, params = (lambda x: module.llm(input_ids=x).logits), module.llm.parameters
    else:
        module = LLMModule(OWN, lr=LR, weight_decay=DECAY, warmup_steps=WARMUP, max_steps=STEPS,
                           global_batch_size=GLOBAL)
        module.configure_model()
        logits_of, params = module.model, module.model.parameters
    configured = module.configure_optimizers()
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    losses, norms = [], []
    for tokens, labels in batches:
        loss = alone(logits_of, tokens, labels, eod)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(list(params()), 0.3).item())
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


#: Kept for the suite's time: both models at dp2 (2 s and 7 s here). tp2 x pp2 x dp2 through the command line passed too
#: for both (12 s and 20 s: eight processes each) and is covered without it, in one launch of 8 ranks of 2-3 s, by
#: tests/distributed/test_sft.py and test_sft_hf.py.
CASES = [("own", "dp2"), ("hf", "dp2")]


@pytest.mark.parametrize("model, layout", CASES)
def test_mgpu_train_data_sft_matches_one_process(prepared, model, layout, tmp_path):
    """Broken once: HFCausalLM's pipeline loss without num_items_in_batch failed hf-3d (4e-3 off)."""
    labels = packed_batches(prepared / "chat")[1][0][1]
    halves = [int((labels[lo:lo + GLOBAL // 2, 1:] != -100).sum()) for lo in (0, GLOBAL // 2)]
    assert halves[0] != halves[1], halves  # the two data ranks count different numbers of answer tokens
    run_dir = tmp_path / "run"
    which = [f"model=hf", f"model.path={prepared / 'llama'}"] if model == "hf" else OWN_ARGS
    proc = run_cli([str(BIN / "mgpu-train"), "data=sft", f"data.path={prepared / 'chat'}", *which, *LAYOUTS[layout],
                    f"data.seq_len={SEQ}", f"data.global_batch_size={GLOBAL}", f"data.micro_batch_size={MICRO}",
                    "data.val_fraction=0.05", "data.val_batches=1", f"seed={SEED}", f"trainer.max_steps={STEPS}",
                    "trainer.gradient_clip_val=0.3", f"optim.lr={LR}", f"optim.warmup_steps={WARMUP}",
                    f"optim.weight_decay={DECAY}", "sample.prompt=0", "sample.max_new_tokens=2",
                    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                    f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    expected = one_process(model, prepared)
    metrics = run_dir / "metrics.csv"
    losses, norms = read_metric(metrics, "train/loss"), read_metric(metrics, "train/grad_norm")
    assert max_abs_diff(losses, expected["losses"]) < 1e-5, (losses, expected["losses"])
    assert max_abs_diff(norms, expected["grad_norms"]) < 1e-5, (norms, expected["grad_norms"])
    assert len(read_metric(metrics, "val/loss")) == 1
