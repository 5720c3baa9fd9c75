"""The trainer's optimizer step against an independent count: its gradients against an eager CPU model's
on the same micro-batches, and its update against torch.optim.AdamW driven here by hand (clipping by the
total norm, decoupled weight decay, the schedule's learning rate counted by hand); --grad-accum 2 at batch
B against batch 2B in one step each."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers

from train import trainer as trainer_module
from train.__main__ import main

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

PEAK_LR, WEIGHT_DECAY, MAX_GRAD_NORM = 4e-3, 0.5, 0.05


def _cpu(tensors):
    return [t.detach().cpu().clone() for t in tensors]


@pytest.fixture(scope="module")
def second_step(bert, docs_csv, tmp_path_factory):
    """What the trainer's second optimizer step saw and did (3 steps, 2 micro-batches of 4 rows each, no
    warm-up, no dropout): the micro-batches, the parameters and AdamW state before, the gradients it was
    handed, the learning rate, and the parameters after."""
    seen: dict = {"micro_batches": [], "updates": 0}
    real_gradients, real_update = trainer_module.micro_batch_gradients, trainer_module.optimizer_update

    def gradients(model, inputs, config):
        if seen["updates"] == 1:
            seen["micro_batches"].append({name: t.detach().cpu() for name, t in inputs.items()})
        return real_gradients(model, inputs, config)

    def update(model, optimizer, config, spmd=None):
        import torch_xla

        # Read only after a full sync: reading one tensor at a time while in-place updates are pending runs a
        # partial graph that may donate buffers the other pending tensors still read (wrong values, seen with
        # torch_xla 2.9). The trainer syncs right after this function; here it is only earlier.
        torch_xla.sync()
        parameters = list(model.parameters())
        if seen["updates"] == 1:
            seen.update(config=model.config, lr=optimizer.param_groups[0]["lr"], grads=_cpu(p.grad for p in parameters),
                        names=[name for name, _ in model.named_parameters()],
                        optimizer={"state": {i: {k: v.detach().cpu().clone() for k, v in s.items()}
                                             for i, s in optimizer.state_dict()["state"].items()},
                                   "param_groups": optimizer.state_dict()["param_groups"]})
        real_update(model, optimizer, config, spmd)
        torch_xla.sync()
        if seen["updates"] == 0:
            seen["before"] = _cpu(parameters)
        elif seen["updates"] == 1:
            seen["after"] = _cpu(parameters)
        seen["updates"] += 1

    patch = pytest.MonkeyPatch()
    patch.setattr(trainer_module, "micro_batch_gradients", gradients)
    patch.setattr(trainer_module, "optimizer_update", update)
    try:
        out = tmp_path_factory.mktemp("optimizer") / "run"
        assert main(["--model", bert, "--dataset", docs_csv, "--batch-size", "4", "--grad-accum", "2",
                     "--max-steps", "3", "--warmup", "0", "--lr", str(PEAK_LR), "--weight-decay", str(WEIGHT_DECAY),
                     "--max-grad-norm", str(MAX_GRAD_NORM), "--dropout", "0", "--eval-batches", "1",
                     "--output-dir", str(out)]) == 0
    finally:
        patch.undo()
    assert seen["updates"] == 3 and len(seen["micro_batches"]) == 2
    return seen


def test_accumulated_gradients_are_the_mean_over_the_micro_batches(second_step):
    """An eager model on the CPU with the step's parameters: the mean of its two micro-batch gradients is
    what the trainer handed the optimizer."""
    config = copy.deepcopy(second_step["config"])
    reference = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")
    reference.load_state_dict(dict(zip(second_step["names"], second_step["before"])), strict=False)
    reference.train()
    for inputs in second_step["micro_batches"]:
        (reference(**inputs).loss / 2).backward()
    expected = dict(reference.named_parameters())
    for name, got in zip(second_step["names"], second_step["grads"]):
        want = expected[name].grad
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 1e-4 * scale + 1e-9, name


def test_the_update_is_adamw_on_the_gradients_clipped_by_their_total_norm(second_step):
    # No warm-up over 3 steps: the second step's learning rate is the peak's 1 - 2/4 (linear decay).
    lr = PEAK_LR * (1 - 2 / 4)
    assert second_step["lr"] == pytest.approx(lr, rel=1e-12)
    grads = [g.double() for g in second_step["grads"]]
    total = sum((g * g).sum() for g in grads).sqrt().item()
    assert total > 2 * MAX_GRAD_NORM, f"gradient norm {total:.3g}: this test needs clipping to act"
    parameters = [p.clone().requires_grad_() for p in second_step["before"]]
    for p, g in zip(parameters, second_step["grads"]):
        p.grad = g * (MAX_GRAD_NORM / (total + 1e-6))
    adamw = torch.optim.AdamW(parameters, lr=lr, weight_decay=WEIGHT_DECAY)
    adamw.load_state_dict(copy.deepcopy(second_step["optimizer"]))  # it would update the captured state in place
    for group in adamw.param_groups:  # the loaded groups carry the trainer's settings (decay applied apart)
        group.update(lr=lr, weight_decay=WEIGHT_DECAY)
    adamw.step()
    for name, got, want in zip(second_step["names"], second_step["after"], parameters):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _final_weights(folder) -> dict:
    return torch.load(os.path.join(folder, "checkpoints", "step-00000001.pt"), weights_only=False)["model"]


def test_two_micro_batches_of_b_train_the_weights_of_one_batch_of_2b(bert, docs_csv, tmp_path):
    common = ["--model", bert, "--dataset", docs_csv, "--max-steps", "1", "--lr", "1e-2", "--dropout", "0",
              "--eval-batches", "1", "--max-grad-norm", "0"]
    assert main(common + ["--batch-size", "4", "--grad-accum", "2", "--output-dir", str(tmp_path / "accum")]) == 0
    assert main(common + ["--batch-size", "8", "--grad-accum", "1", "--output-dir", str(tmp_path / "whole")]) == 0
    with open(tmp_path / "accum" / "metrics.jsonl") as f:
        accum_loss = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    with open(tmp_path / "whole" / "metrics.jsonl") as f:
        whole_loss = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    assert accum_loss == pytest.approx(whole_loss, rel=1e-5), "the same rows: the same mean loss"
    accum, whole = _final_weights(tmp_path / "accum"), _final_weights(tmp_path / "whole")
    assert accum.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(accum[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)
    initial = transformers.BertModel.from_pretrained(bert).state_dict()
    moved = [name for name, t in initial.items() if not torch.equal(whole[f"bert.{name}"], t)]
    assert len(moved) > len(initial) // 2, "the step left most weights where they were"
