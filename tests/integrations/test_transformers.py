"""qhoptim.torch in Hugging Face's Trainer (the recipe in docs/integrations.md)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from qhoptim import reference  # noqa: E402
from qhoptim.torch import QHAdamW  # noqa: E402


class _RecordFirstStep(transformers.TrainerCallback):  # type: ignore[misc]
    """Each parameter's value and gradient just before the first optimizer step, and after."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.before: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.after: dict[str, np.ndarray] = {}

    def _values(self) -> dict[str, np.ndarray]:
        return {n: p.detach().double().numpy().copy() for n, p in self.model.named_parameters()}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 0:
            self.before = self._values()
            self.grads = {
                n: p.grad.double().numpy().copy()
                for n, p in self.model.named_parameters()
                if p.grad is not None
            }

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 0:
            self.after = self._values()


def test_trainer_takes_qhadamw_from_optimizer_cls_and_kwargs(tmp_path: Any) -> None:
    # A tiny BERT built from a config: nothing is downloaded.
    config = transformers.BertConfig(
        vocab_size=32,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(0, 32, (6,), generator=gen), "labels": i % 2} for i in range(16)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        weight_decay=0.01,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the recorded gradient is the one stepped
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    # The Trainer passes the optimizer only these keywords (and its param
    # groups): args.learning_rate does not reach it, so lr is given here.
    kwargs = {"lr": 1e-2, "betas": (0.95, 0.999), "nus": (0.7, 1.0), "eps": 1e-8}
    record = _RecordFirstStep(model)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizer_cls_and_kwargs=(QHAdamW, kwargs),
        callbacks=[record],
    )
    trainer.train()
    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", opt)  # accelerate's wrapper, when there is one
    assert type(inner) is QHAdamW
    decays = {g["weight_decay"] for g in inner.param_groups}
    assert decays == {0.0, 0.01}  # the Trainer's split: no decay on biases and LayerNorm
    assert all(float(s["step"]) == 3 for s in inner.state.values())
    # The first step is QHAdamW's, parameter by parameter, from the reference.
    decay_of = {id(p): g["weight_decay"] for g in inner.param_groups for p in g["params"]}
    stepped = 0
    for name, p in model.named_parameters():
        if name not in record.grads:
            continue
        ref = reference.QHAdamW(weight_decay=decay_of[id(p)], **kwargs)
        x0 = record.before[name]
        want, _ = ref.step(x0, record.grads[name], ref.init(x0))
        np.testing.assert_allclose(record.after[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
        stepped += 1
    assert stepped >= 10
