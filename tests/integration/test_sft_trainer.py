"""SFTTrainer end to end on the toy world: full, packed, LoRA (+ merge), QLoRA (bitsandbytes nf4)."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_rlhf import ModelConfig, SFTConfig, SFTTrainer
from hf_rlhf.toy import build_toy_model, sft_dataset

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def train_rows():
    return sft_dataset(256, seed=1, split="train")


def make_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, learning_rate=3e-3,
                    max_steps=12, logging_steps=4, save_strategy="no", report_to="none", max_length=64,
                    seed=0, disable_tqdm=True, warmup_steps=0)
    defaults.update(kw)
    return SFTConfig(**defaults)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_full_sft_learns_logs_and_saves(tmp_path, tokenizer, train_rows):
    model = build_toy_model(tokenizer, "tiny", seed=0)
    before = snapshot(model)
    trainer = SFTTrainer(model, args=make_args(tmp_path), train_dataset=train_rows, processing_class=tokenizer)
    trainer.train()
    hist = losses(trainer)
    assert hist[-1] < hist[0] - 0.3, hist
    logged = trainer.state.log_history[0]
    assert 0.0 <= logged["mean_token_accuracy"] <= 1.0 and logged["entropy"] > 0
    assert logged["num_tokens"] > 0
    after = snapshot(model)
    assert all(not torch.equal(before[n], after[n]) for n in before)

    trainer.save_model()
    out = trainer.args.output_dir
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([tokenizer("1+2=")["input_ids"]])
    model.eval()
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))


def test_completion_only_loss_masks_the_prompt(tmp_path, tokenizer, train_rows):
    trainer = SFTTrainer(build_toy_model(tokenizer, "tiny"), args=make_args(tmp_path, max_steps=1),
                         train_dataset=train_rows, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    for row, labels in zip(range(4), batch["labels"]):
        prepared = trainer.train_dataset[row]["labels"]  # TRL's labels column, built from the completion mask
        n_prompt = next(i for i, label in enumerate(prepared) if label != -100)
        assert n_prompt > 0
        assert (labels[:n_prompt] == -100).all()
        assert (labels[n_prompt:len(prepared)] != -100).all()


@pytest.mark.parametrize("mode", ["packing", "padding_free"])
def test_packed_batches_always_run_with_cache_off(tmp_path, tokenizer, train_rows, mode):
    model = build_toy_model(tokenizer, "tiny")
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("use_cache")), with_kwargs=True)
    trainer = SFTTrainer(model, args=make_args(tmp_path, max_steps=3, **{mode: True}),
                         train_dataset=train_rows, processing_class=tokenizer)
    model.config.use_cache = True  # a user (or a generate() call) turning the cache back on
    trainer.train()
    assert seen and all(v is False for v in seen), seen
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch
    # padding-free flattens the batch into one row; pre-packed rows stay rows on sdpa (PackingCollator(flatten=False))
    rows = batch["input_ids"].shape[0]
    assert (rows == 1) if mode == "padding_free" else (rows > 1), rows


def test_padding_free_loss_equals_padded_loss(tmp_path, tokenizer, train_rows):
    model = build_toy_model(tokenizer, "tiny").eval()
    rows = train_rows.select(range(8))
    results = []
    for mode in ({}, {"padding_free": True}):
        trainer = SFTTrainer(model, args=make_args(tmp_path, **mode), train_dataset=rows, processing_class=tokenizer)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
        with torch.no_grad():
            results.append(trainer.compute_loss(model, batch).item())
    assert abs(results[0] - results[1]) < 1e-5, results


def test_lora_trains_only_adapters_saves_reloads_and_merges(tmp_path, tokenizer, train_rows):
    from peft import PeftModel

    from hf_rlhf.models.merge import merge_adapter

    base_dir = str(tmp_path / "base")
    build_toy_model(tokenizer, "tiny", seed=0).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model_config = ModelConfig(model_name_or_path=base_dir, use_peft=True, lora_r=8, lora_alpha=16,
                               lora_dropout=0.0)
    trainer = SFTTrainer(base_dir, args=make_args(tmp_path, learning_rate=1e-2), train_dataset=train_rows,
                         processing_class=tokenizer, model_config=model_config)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train()
    hist = losses(trainer)
    assert hist[-1] < hist[0], hist
    trainer.save_model()
    out = trainer.args.output_dir
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))

    ids = torch.tensor([tokenizer("12+7=")["input_ids"]])
    trained = trainer.model.eval()
    with torch.no_grad():
        expected = trained(ids).logits
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out).eval()
        torch.testing.assert_close(reloaded(ids).logits, expected)
        merged_dir = str(tmp_path / "merged")
        merge_adapter(out, merged_dir)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
        base_logits = AutoModelForCausalLM.from_pretrained(base_dir)(ids).logits
        assert not torch.allclose(base_logits, expected, atol=1e-3)  # the adapter did change the model


def test_merge_cli_writes_a_plain_model(tmp_path, tokenizer):
    from peft import LoraConfig, get_peft_model

    from hf_rlhf.models.merge import main

    base_dir, adapter_dir, out = (str(tmp_path / d) for d in ("base", "adapter", "merged"))
    build_toy_model(tokenizer, "tiny").save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    peft_model.save_pretrained(adapter_dir)
    main(["--adapter", adapter_dir, "--output", out])
    assert os.path.isfile(os.path.join(out, "config.json"))
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        main(["--adapter", base_dir, "--output", str(tmp_path / "bad")])
    assert not os.path.exists(tmp_path / "bad")


def test_qlora_nf4_double_quant_trains_saves_and_reloads(tmp_path, tokenizer, train_rows):
    bnb = pytest.importorskip("bitsandbytes")
    from peft import PeftModel

    from hf_rlhf.models.loading import load_model

    base_dir = str(tmp_path / "base")
    build_toy_model(tokenizer, "tiny", seed=0).save_pretrained(base_dir)
    model_config = ModelConfig(model_name_or_path=base_dir, use_peft=True, load_in_4bit=True,
                               bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               lora_r=8, lora_alpha=16, lora_dropout=0.0)
    trainer = SFTTrainer(base_dir, args=make_args(tmp_path, learning_rate=1e-2, optim="adamw_bnb_8bit"),
                         train_dataset=train_rows, processing_class=tokenizer, model_config=model_config)
    linears = [m for n, m in trainer.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) >= 7 * 2  # q,k,v,o,gate,up,down in each of the tiny model's layers
    assert all(m.weight.quant_state.nested for m in linears)
    trainer.train()
    hist = losses(trainer)
    assert hist[-1] < hist[0], hist
    trainer.save_model()

    ids = torch.tensor([tokenizer("3+4=")["input_ids"]])
    with torch.no_grad():
        expected = trainer.model.eval()(ids).logits
        reloaded = PeftModel.from_pretrained(load_model(model_config), trainer.args.output_dir).eval()
        torch.testing.assert_close(reloaded(ids).logits, expected)


def test_conversational_assistant_only_loss_trains(tmp_path, tokenizer):
    rows = sft_dataset(128, seed=2, split="train", format="messages")
    trainer = SFTTrainer(build_toy_model(tokenizer, "tiny"),
                         args=make_args(tmp_path, assistant_only_loss=True, max_steps=6, logging_steps=2),
                         train_dataset=rows, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert "assistant_masks" not in trainer.train_dataset.column_names  # replaced by labels, as TRL
    for row, labels in enumerate(batch["labels"]):
        prepared = torch.tensor(trainer.train_dataset[row]["labels"])
        n = len(prepared)
        assert (prepared == -100).any() and (prepared != -100).any()  # user turns masked, assistant turns not
        assert torch.equal(labels[:n], prepared)
    trainer.train()
    hist = losses(trainer)
    assert hist[-1] < hist[0]


@pytest.mark.parametrize("fmt", ["prompt_completion", "text"])
def test_tokenizer_without_pad_token_pads_with_eos_and_keeps_eos_trained(tmp_path, tokenizer, fmt):
    """As TRL: no pad token -> eos pads. Labels come from masks and are padded with -100, so every real eos (the
    last token of each row) is still a label, while the padding after it is not."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.pad_token = None
    rows = sft_dataset(8, seed=3, format=fmt)
    trainer = SFTTrainer(build_toy_model(tok, "tiny"), args=make_args(tmp_path, max_steps=2),
                         train_dataset=rows, processing_class=tok)
    assert tok.pad_token_id == tok.eos_token_id
    features = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(features)
    for row, feature in enumerate(features):
        n = len(feature["input_ids"])
        assert feature["input_ids"][-1] == tok.eos_token_id
        assert batch["labels"][row, n - 1].item() == tok.eos_token_id  # the real eos is trained on
        assert (batch["labels"][row, n:] == -100).all()  # the eos padding after it is not
    assert any(len(f["input_ids"]) < batch["input_ids"].shape[1] for f in features)  # some row was padded
    trainer.train()
    assert all(torch.isfinite(torch.tensor(losses(trainer))))


@pytest.mark.parametrize("packing", [False, True])
def test_evaluate_prepares_a_raw_dataset_passed_to_it(tmp_path, tokenizer, train_rows, packing):
    """As TRL: `evaluate(eval_dataset=raw_rows)` tokenizes (and packs) the rows like an eval set given at init, in
    memory or streamed; the loss equals the one of the same rows given at init."""
    from datasets import load_dataset

    raw = sft_dataset(12, seed=4, format="prompt_completion")
    args = make_args(tmp_path, max_steps=1, packing=packing, per_device_eval_batch_size=4)
    at_init = SFTTrainer(build_toy_model(tokenizer, "tiny"), args=args, train_dataset=train_rows,
                         eval_dataset=raw, processing_class=tokenizer).evaluate()
    trainer = SFTTrainer(build_toy_model(tokenizer, "tiny"), args=args, train_dataset=train_rows,
                         processing_class=tokenizer)
    passed = trainer.evaluate(eval_dataset=raw)
    assert passed["eval_loss"] == pytest.approx(at_init["eval_loss"], abs=1e-6)
    named = trainer.evaluate(eval_dataset={"held_out": raw})
    assert named["eval_held_out_loss"] == pytest.approx(at_init["eval_loss"], abs=1e-6)
    path = str(tmp_path / "eval.jsonl")
    raw.to_json(path)
    streamed = trainer.evaluate(eval_dataset=load_dataset("json", data_files=path, split="train", streaming=True))
    if not packing:  # a packed stream is packed in windows, so its rows differ; its loss is still a loss
        assert streamed["eval_loss"] == pytest.approx(at_init["eval_loss"], abs=1e-5)
    assert streamed["eval_loss"] > 0


def test_a_run_ending_between_logging_steps_logs_its_metrics_in_the_last_record(tmp_path, tokenizer, train_rows):
    """As TRL: 9 steps with logging_steps=10 log no training record, so the closing summary carries the
    accumulated metrics (mean_token_accuracy, entropy, num_tokens)."""
    trainer = SFTTrainer(build_toy_model(tokenizer, "tiny"), args=make_args(tmp_path, max_steps=9, logging_steps=10),
                         train_dataset=train_rows, processing_class=tokenizer)
    trainer.train()
    last = trainer.state.log_history[-1]
    assert "train_runtime" in last and not losses(trainer)  # no logging step was reached
    assert 0 <= last["mean_token_accuracy"] <= 1 and last["entropy"] > 0 and last["num_tokens"] > 0
    # a run that ends on a logging step has nothing left over: the summary repeats nothing
    trainer = SFTTrainer(build_toy_model(tokenizer, "tiny"), args=make_args(tmp_path, max_steps=4, logging_steps=2),
                         train_dataset=train_rows, processing_class=tokenizer)
    trainer.train()
    assert "mean_token_accuracy" not in trainer.state.log_history[-1]


def test_trl_checks_tags_and_aux_loss_flag(tmp_path, tokenizer, train_rows):
    """TRL's: `train_dataset=None` refused at init, the trainer's tags on the model (LoRA too), `aux_loss_enabled`
    (False for a dense model), a dataset with a transform refused with the way out."""
    from peft import LoraConfig

    with pytest.raises(ValueError, match="`train_dataset` is required"):
        SFTTrainer(build_toy_model(tokenizer, "tiny"), args=make_args(tmp_path), processing_class=tokenizer)
    for peft_config in (None, LoraConfig(r=4, target_modules=["q_proj"])):
        trainer = SFTTrainer(build_toy_model(tokenizer, "tiny"), args=make_args(tmp_path), train_dataset=train_rows,
                             processing_class=tokenizer, peft_config=peft_config)
        assert {"trl", "sft", "hf_rlhf"} <= set(trainer.model.model_tags)
        assert trainer.aux_loss_enabled is False
    transformed = sft_dataset(8, seed=0).with_transform(lambda batch: batch)
    with pytest.raises(ValueError, match=r"with_transform\(\).*skip_prepare_dataset.*trainer-ready"):
        SFTTrainer(build_toy_model(tokenizer, "tiny"), args=make_args(tmp_path), train_dataset=transformed,
                   processing_class=tokenizer)


def test_sharegpt_rows_train_as_their_chatml_rows(tmp_path, tokenizer):
    """As TRL: `conversations` of `from` / `value` messages are converted to `messages` before anything else, for
    training and for a dataset passed to `evaluate`."""
    from datasets import Dataset

    chatml = sft_dataset(8, seed=2, format="messages")
    sharegpt = Dataset.from_list(
        [{"conversations": [{"from": m["role"], "value": m["content"]} for m in row["messages"]]} for row in chatml])
    args = make_args(tmp_path, max_steps=1, per_device_eval_batch_size=4)
    ours = SFTTrainer(build_toy_model(tokenizer, "tiny"), args=args, train_dataset=sharegpt, processing_class=tokenizer)
    theirs = SFTTrainer(build_toy_model(tokenizer, "tiny"), args=args, train_dataset=chatml, processing_class=tokenizer)
    assert ours.train_dataset["input_ids"] == theirs.train_dataset["input_ids"]
    assert ours.evaluate(eval_dataset=sharegpt)["eval_loss"] == pytest.approx(
        ours.evaluate(eval_dataset=chatml)["eval_loss"], abs=1e-6)


def test_compiled_toy_sft_batches_all_have_one_shape(tmp_path):
    """docs/sft.md's compiled toy SFT (`--torch_compile true --pad_to_multiple_of 128 --dataloader_drop_last true`):
    every batch, the last of each epoch included, has the one shape inductor compiled for; a new width or batch
    size compiles again (30-40 s each here, three times over a toy run without the two options). The toy config as
    shipped (no padding to a fixed width, a short last batch) gives several shapes from the same rows."""
    from recipes import sft

    def shapes(*options):
        script_args, model_config, args = sft.parse_recipe_args(
            (sft.ScriptArguments, ModelConfig, SFTConfig),
            ["--toy_train_size", "1500", "--toy_model_size", "tiny", "--output_dir", str(tmp_path / "out"),
             *options], sft.TOY_CONFIG)
        train, _ = sft.toy_data(script_args)
        model, tokenizer = sft.prepare_toy_base(model_config, args, "tiny", 0)
        trainer = SFTTrainer(model, args=args, train_dataset=train, processing_class=tokenizer)
        return args, [tuple(batch["input_ids"].shape) for batch in trainer.get_train_dataloader()]

    args, fixed = shapes("--torch_compile", "true", "--pad_to_multiple_of", "128", "--dataloader_drop_last", "true")
    assert args.torch_compile and args.packing
    assert len(fixed) >= 5 and set(fixed) == {(args.per_device_train_batch_size, args.max_length)}
    _, loose = shapes()
    assert len(set(loose)) > 1 and len(loose) >= len(fixed)
