"""The LM head in chunks of tokens (`hf_rlhf.models.lm_head`, `SFTConfig.chunked_lm_head`) on every architecture:
the SFT loss, its gradients and TRL's metrics equal the full-logits path within 1e-5, padded and padding-free, with
`num_items_in_batch`, the DFT loss, an MoE's load-balancing loss, LoRA on the head, tied embeddings and scaled or
soft-capped logits; PPO / GRPO's response log-probs and entropy too; a model whose head does not split is refused
by name (or, with `chunked_lm_head=None`, trained on the full logits)."""

import logging

import pytest
import torch
from datasets import Dataset
from torch.testing import assert_close
from zoo_models import MODEL_TYPES, PAD_ID, TOKENIZER, build, build_config, random_sequences

from hf_rlhf import SFTConfig, SFTTrainer
from hf_rlhf.models import lm_head
from hf_rlhf.models.lm_head import HeadSplitError, split_lm_head

SHAPES = [(9, 3), (5, 2), (12, 4), (7, 0)]  # (length, prompt length)


def examples():
    sequences = random_sequences([n for n, _ in SHAPES], seed=5)
    return [{"input_ids": s, "completion_mask": [0] * p + [1] * (len(s) - p)} for s, (_, p) in zip(sequences, SHAPES)]


def trainer_for(tmp_path, model, chunked, layout="padded", **options):
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=24, per_device_train_batch_size=4,
                     save_strategy="no", disable_tqdm=True, packing_check=False, chunked_lm_head=chunked,
                     **({} if layout == "padded" else {layout: True}), **options)
    return SFTTrainer(model, args=args, train_dataset=Dataset.from_list(examples()), processing_class=TOKENIZER)


def step(trainer, num_items_in_batch=None):
    """(loss, {name: grad} of the trainable parameters, {metric: value}) of one compute_loss + backward."""
    model = trainer.model.train()
    model.zero_grad(set_to_none=True)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    loss = trainer.compute_loss(model, batch, num_items_in_batch=num_items_in_batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, trainer.metrics["train"].totals()  # {name: (sum, weight)}


def assert_same_step(tmp_path, model, num_items_in_batch=None, layout="padded", **options):
    plain, chunked = (trainer_for(tmp_path, model, c, layout, **options) for c in (False, True))
    assert plain.lm_head is None and chunked.lm_head is not None
    (loss_p, grads_p, metrics_p), (loss_c, grads_c, metrics_c) = (step(t, num_items_in_batch) for t in (plain, chunked))
    assert_close(loss_c, loss_p, atol=1e-5, rtol=1e-5)
    assert grads_c.keys() == grads_p.keys() and grads_p
    for name in grads_p:
        assert_close(grads_c[name], grads_p[name], atol=1e-5, rtol=1e-4, msg=name)
    assert metrics_c.keys() == metrics_p.keys() >= {"entropy", "mean_token_accuracy", "num_tokens"}
    for name, (total, weight) in metrics_p.items():  # a token mean's sum is over ~20 tokens: rel 1e-6
        assert metrics_c[name] == pytest.approx((total, weight), rel=1e-6, abs=1e-5), name
    return metrics_c


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sft_loss_gradients_and_metrics_equal_the_full_logits(tmp_path, model_type, layout):
    assert_same_step(tmp_path, build(model_type), layout=layout)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_num_items_in_batch_and_dft(tmp_path, model_type):
    model = build(model_type)
    assert_same_step(tmp_path, model, num_items_in_batch=torch.tensor(57))
    assert_same_step(tmp_path, model, loss_type="dft")
    assert_same_step(tmp_path, model, num_items_in_batch=torch.tensor(57), loss_type="dft")


def test_moe_load_balancing_loss_is_added(tmp_path):
    metrics = assert_same_step(tmp_path, build("qwen2_moe"), router_aux_loss_coef=0.5)
    assert metrics["aux_loss"][0] > 0


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2", "qwen2_moe"])
def test_lora_on_the_head(tmp_path, model_type):
    """A peft LoRA layer wrapping `lm_head` (run per chunk under checkpointing) and LoRA in the body."""
    from peft import LoraConfig, get_peft_model

    head = "lm_head" if model_type != "gpt_neox" else "embed_out"
    model = get_peft_model(build(model_type), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "c_attn",
                                                                                           "q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    assert type(split_lm_head(model).module).__module__.startswith("peft")
    assert_same_step(tmp_path, model)
    assert any(head in name for name in model.state_dict() if "lora_B" in name)


def test_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    config = build_config("llama")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert_same_step(tmp_path, model)


def small(config_class, **kwargs):
    from transformers import AutoModelForCausalLM

    config = config_class(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD_ID, **kwargs)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def test_scaled_logits_cohere_and_granite(tmp_path):
    """Cohere multiplies its logits by `logit_scale`, Granite divides them by `logits_scaling`."""
    from transformers import CohereConfig, GraniteConfig

    cohere = small(CohereConfig, logit_scale=0.25)
    assert split_lm_head(cohere).scale == 0.25
    assert_same_step(tmp_path, cohere)
    granite = small(GraniteConfig, logits_scaling=4.0)
    assert split_lm_head(granite).scale == 0.25
    assert_same_step(tmp_path, granite)


def test_auto_keeps_the_full_logits_at_a_small_vocabulary(tmp_path):
    """`chunked_lm_head=None` chunks only above `AUTO_MIN_VOCAB`: below it one chunk holds a batch's logits anyway."""
    model = build("llama")
    assert model.get_output_embeddings().weight.shape[0] <= lm_head.AUTO_MIN_VOCAB
    assert trainer_for(tmp_path, model, None).lm_head is None
    assert trainer_for(tmp_path, model, True).lm_head is not None


def test_a_head_that_does_not_split_is_refused_by_name(tmp_path, record_property, caplog, monkeypatch):
    """A model that transforms its logits in a way no config names: True refuses it naming its class, None trains it
    on the full logits with a warning naming it, and the split head is never used."""
    from transformers import LlamaForCausalLM

    class DoubledLogitsLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    monkeypatch.setattr(lm_head, "AUTO_MIN_VOCAB", 0)  # the zoo's vocabulary is small: `None` would not chunk at all
    torch.manual_seed(0)
    model = DoubledLogitsLlama(build_config("llama"))
    with pytest.raises(HeadSplitError, match="DoubledLogitsLlama: its logits are not its LM head") as err:
        trainer_for(tmp_path, model, True)
    record_property("refusal", str(err.value))
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        trainer = trainer_for(tmp_path, model, None)
    assert trainer.lm_head is None and "DoubledLogitsLlama" in caplog.text
    assert torch.isfinite(step(trainer)[0])


def test_prompt_learning_uses_the_full_logits(tmp_path, caplog, monkeypatch):
    from peft import PromptTuningConfig, get_peft_model

    monkeypatch.setattr(lm_head, "AUTO_MIN_VOCAB", 0)
    model = get_peft_model(build("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        trainer = trainer_for(tmp_path, model, None)
    assert trainer.lm_head is None and "prompt-learning" in caplog.text
    with pytest.raises(HeadSplitError, match="prompt-learning"):
        trainer_for(tmp_path, model, True)


# -- PPO / GRPO: the response tokens' log-probs and entropy ---------------------------------------------------------
def rollout_batch():
    from hf_rlhf.collators import LeftPaddingCollator

    prompts, responses = random_sequences([6, 2, 4, 4], seed=7), random_sequences([3, 5, 1, 4], seed=8)
    query = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": p} for p in prompts])
    width = max(map(len, responses))
    response_ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])
    return query["input_ids"], query["attention_mask"], response_ids, response_mask


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_ppo_response_scores_equal_the_full_logits(model_type, share_prompts):
    """`response_scores` with the policy's split head: the log-probs, entropy and values of the response tokens and
    the gradients of a loss on them (an entropy bonus included) equal the full logits' within 1e-5; the reference's
    too; the positions outside the response mask are 0."""
    from hf_rlhf.models.policy_value import PolicyAndValue, response_scores

    module = PolicyAndValue(build(model_type)).train()
    reference = build(model_type, seed=1)
    batch = rollout_batch()
    mask = batch[3].bool()
    share = share_prompts and model_type != "opt"  # OPT cannot take the shared layout's 4D mask
    results = []
    for head in (None, split_lm_head(module.policy)):
        module.zero_grad(set_to_none=True)
        logprobs, entropy, values, _ = response_scores(module, head, *batch, temperature=0.7, share_prompts=share,
                                                       entropy_grad=True)
        loss = (logprobs * 0.3 - entropy * 0.1 + values)[mask].sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        with torch.no_grad():
            ref = response_scores(reference, None if head is None else split_lm_head(reference), *batch,
                                  temperature=0.7, share_prompts=share)[0]
        results.append((logprobs.detach(), entropy.detach(), values.detach(), ref, grads))
    (plain, chunked) = results
    for name, want, got in zip(("log-probs", "entropy", "values", "reference"), plain[:4], chunked[:4]):
        assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5, msg=name)
    assert not chunked[0][~mask].any() and not chunked[3][~mask].any()
    assert chunked[4].keys() == plain[4].keys()
    for name in plain[4]:
        assert_close(chunked[4][name], plain[4][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_grpo_steps_equal_the_full_logits(tmp_path, model_type):
    """Two GRPO steps (rollout old / reference log-probs, the loss with a KL term and an entropy bonus) log the same
    numbers and end at the same weights with `chunked_lm_head` True and False."""
    from hf_rlhf.toy import prompt_dataset
    from hf_rlhf.trainers.ppo_config import PPOConfig
    from hf_rlhf.trainers.ppo_trainer import PPOTrainer

    def run(chunked):
        args = PPOConfig(output_dir=str(tmp_path / f"out{chunked}"), per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, rollout_batch_size=8, num_ppo_epochs=1, response_length=4,
                         max_steps=2, logging_steps=1, save_strategy="no", report_to="none", learning_rate=1e-2,
                         seed=0, disable_tqdm=True, advantage_estimator="grpo", num_generations=4, kl_in_loss=True,
                         kl_estimator="k3", kl_coef=0.1, entropy_coef=0.01, logprobs_from_generation=False,
                         chunked_lm_head=chunked)
        trainer = PPOTrainer(build(model_type), lambda prompts, completions, **kw: [len(c) % 3 for c in completions],
                             args=args, train_dataset=prompt_dataset(16, seed=0), processing_class=TOKENIZER)
        assert (trainer.lm_heads[0] is not None) == chunked and (trainer.lm_heads[1] is not None) == chunked
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return logs, {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}

    (chunked, w_chunked), (plain, w_plain) = run(True), run(False)
    assert len(chunked) == len(plain) == 2
    for a, b in zip(chunked, plain):
        for key in ("loss", "grad_norm", "loss/policy_avg", "loss/kl_avg", "objective/kl", "policy/entropy_avg"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, a[key], b[key])
    for name in w_plain:
        assert_close(w_chunked[name], w_plain[name], atol=1e-5, rtol=1e-4, msg=name)


# -- DPO: the completion log-probs of policy and reference --------------------------------------------------------
@pytest.mark.parametrize("layout", [None, "prefix_sharing", "padding_free"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_dpo_loss_gradients_and_metrics_equal_the_logits(tmp_path, model_type, layout):
    """DPO with the chunked LM head (policy and frozen reference copy): the loss, its gradients and TRL's metrics
    equal `use_logits_to_keep`'s logits within 1e-5, in the padded, prefix-shared and padding-free layouts; WPO
    weights (log Σ p²) and LD-DPO included."""
    from hf_rlhf import DPOConfig, DPOTrainer
    from hf_rlhf.toy import preference_dataset

    model = build(model_type, seed=1)
    moe = {"router_aux_loss_coef": 0.0} if hasattr(model.config, "router_aux_loss_coef") else {}
    results = []
    for chunked in (False, True):
        args = DPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=64, save_strategy="no",
                         disable_tqdm=True, packing_check=False, chunked_lm_head=chunked, use_weighting=True,
                         ld_alpha=0.5, **({layout: True} if layout else {}), **moe)
        trainer = DPOTrainer(model, args=args, train_dataset=preference_dataset(6, seed=3, split="train"),
                             processing_class=TOKENIZER)
        assert (trainer.lm_heads["policy"] is not None) == chunked
        assert (trainer.lm_heads["reference"] is not None) == chunked
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
        trainer.model.train().zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, trainer.metrics["train"].totals()))
    (loss_p, grads_p, metrics_p), (loss_c, grads_c, metrics_c) = results
    assert_close(loss_c, loss_p, atol=1e-5, rtol=1e-5)
    assert grads_c.keys() == grads_p.keys() and grads_p
    for name in grads_p:
        assert_close(grads_c[name], grads_p[name], atol=1e-5, rtol=1e-4, msg=name)
    assert metrics_c.keys() == metrics_p.keys() >= {"entropy", "mean_token_accuracy", "logits/chosen"}
    for name, (total, weight) in metrics_p.items():
        assert metrics_c[name] == pytest.approx((total, weight), rel=1e-5, abs=1e-5), name
