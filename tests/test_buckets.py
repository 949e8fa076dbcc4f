"""Ragged text padded to a few lengths (issue 45): what make_loader hands over equals what
the tokenizer itself pads to that length, on the host, with and without workers; text
already of one length, and `buckets=False`, are left alone; report() names padding when
the shapes keep changing. The XLA run (compiles, losses against exact padding on CPU
torch) is in test_hf.py."""
import pytest
import torch

pytest.importorskip("transformers")

import tpu_utility as tu  # noqa: E402
from tpu_utility.engines.local import Local  # noqa: E402
from tpu_utility.replica import Replica, activate  # noqa: E402

import hf_fns  # noqa: E402

LADDER = [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]  # powers of 2 and 1.5x them


def expected_length(n, cap=40):
    target = min(b for b in LADDER if b >= n)
    return cap if n <= cap < target else target


def batches(loader):
    with activate(Replica(Local())):
        return list(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_ragged_batches_equal_the_tokenizers_own_padding_to_the_bucket(workers):
    from transformers import DataCollatorWithPadding
    tok = hf_fns.make_tokenizer()
    data = hf_fns.RaggedTexts(96, 3)
    loader = tu.make_loader(data, 8, train=False, num_workers=workers,
                            collate_fn=DataCollatorWithPadding(tok))
    got = batches(loader)
    assert len(got) == 12
    for k, batch in enumerate(got):
        rows = [data[i] for i in range(8 * k, 8 * k + 8)]
        longest = max(len(r["input_ids"]) for r in rows)
        want = tok.pad(rows, padding="max_length", max_length=expected_length(longest),
                       return_tensors="pt")
        assert sorted(batch) == sorted(want), k
        for key in want:
            assert torch.equal(batch[key], want[key]), (k, key)
    assert len({b["input_ids"].shape[1] for b in got}) < len(
        {max(len(data[i]["input_ids"]) for i in range(8 * k, 8 * k + 8)) for k in range(12)})


def test_per_token_labels_keep_the_collates_fill_and_left_padding_gains_right_padding():
    from transformers import DataCollatorForTokenClassification
    tok = hf_fns.make_tokenizer(padding_side="left")
    rows = [{"input_ids": list(range(4, 4 + k)), "labels": [1] * k} for k in (3, 17, 9)]
    loader = tu.make_loader(rows, 3, train=False, num_workers=0,
                            collate_fn=DataCollatorForTokenClassification(tok))
    (batch,) = batches(loader)
    assert batch["input_ids"].shape == (3, 24)
    exact = DataCollatorForTokenClassification(tok)(rows)  # left-padded to 17
    assert torch.equal(batch["input_ids"][:, :17], exact["input_ids"])
    assert torch.equal(batch["labels"][:, :17], exact["labels"])
    assert torch.equal(batch["attention_mask"][:, :17], exact["attention_mask"])
    assert (batch["input_ids"][:, 17:] == 0).all() and (batch["attention_mask"][:, 17:] == 0).all()
    assert (batch["labels"][:, 17:] == -100).all()


def test_text_of_one_length_and_buckets_false_are_left_alone_and_lengths_can_be_given():
    from transformers import DataCollatorWithPadding
    tok = hf_fns.make_tokenizer()
    fixed = [{"input_ids": [5] * 20, "attention_mask": [1] * 20, "labels": 0}] * 8
    (batch,) = batches(tu.make_loader(fixed, 8, train=False, num_workers=0,
                                      collate_fn=DataCollatorWithPadding(tok)))
    assert batch["input_ids"].shape == (8, 20)  # samples already of one length: no bucket
    (batch,) = batches(tu.make_loader(fixed, 8, train=False, num_workers=0, buckets=True,
                                      collate_fn=DataCollatorWithPadding(tok)))
    assert batch["input_ids"].shape == (8, 24)  # buckets=True: every such batch
    ragged = [{"input_ids": [5] * k, "labels": 0} for k in (3, 50, 7, 90)]
    for buckets, want in ((False, 90), ([64, 128], 128), ([32, 64], 90)):
        (batch,) = batches(tu.make_loader(ragged, 4, train=False, num_workers=0, buckets=buckets,
                                          collate_fn=DataCollatorWithPadding(tok)))
        assert batch["input_ids"].shape == (4, want), buckets
    for bad, error in (("auto", TypeError), ([64, 32], ValueError), ([0, 8], ValueError)):
        with pytest.raises(error, match="buckets"):
            tu.make_loader(ragged, 4, num_workers=0, buckets=bad)


def test_a_padded_loader_gives_the_users_collate_its_samples_alone():
    # pad=True (evaluation: train_one_cycle's valid_loader, predict) pairs each sample with
    # its valid flag; the user's collate must still get the samples it was written for.
    from transformers import DataCollatorWithPadding
    data = hf_fns.RaggedTexts(10, 4)
    loader = tu.make_loader(data, 4, train=False, pad=True, num_workers=0,
                            collate_fn=DataCollatorWithPadding(hf_fns.make_tokenizer()))
    got = batches(loader)
    assert [valid.tolist() for _, valid in got] == [[True] * 4, [True] * 4, [True, True, False, False]]
    assert torch.equal(got[2][0]["labels"], torch.tensor([data[i]["labels"] for i in (8, 9, 0, 1)]))


def test_report_names_padding_when_the_shapes_keep_changing(run_script):
    r = run_script("""
        import json, torch, torch.nn as nn
        import tpu_utility as tu, hf_fns
        from transformers import DataCollatorWithPadding

        class Bag(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.head = nn.Embedding(hf_fns.VOCAB, 8), nn.Linear(8, 2)

            def forward(self, input_ids, attention_mask, labels):
                m = attention_mask.unsqueeze(-1).float()
                logits = self.head((self.emb(input_ids) * m).sum(1) / m.sum(1))
                return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

        def fit(buckets):
            model = Bag().to(tu.get_device())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            train_loader = tu.make_loader(hf_fns.RaggedTexts(192, 0), 8, num_workers=0, buckets=buckets,
                                          collate_fn=DataCollatorWithPadding(hf_fns.make_tokenizer()))
            hist = tu.train_one_cycle(model, train_loader, opt, 3, 0.1, progress=False)
            return {"compiles": [e.compiles for e in hist.epochs],
                    "hints": tu.report(hist, verbose=False).hints}

        if __name__ == "__main__":
            print("RESULT", json.dumps({str(b): tu.run(fit, cores=1, args=(b,), start_method="fork") for b in (False, None)}))
    """, timeout=300).result
    exact, bucketed = r["False"], r["None"]
    # lengths 4-44: 5 buckets (16, 24, 32, 40 the tokenizer's limit, 48); each batch its own
    # longest row otherwise
    assert exact["compiles"][2] > 0 and sum(bucketed["compiles"]) <= 8, r
    (hint,) = [h for h in exact["hints"] if "compiles" in h]
    assert "`train_loader` gave batches of" in hint and "buckets=True" in hint, hint
    assert not any("compiles" in h for h in bucketed["hints"]), r


def test_after_the_first_epoch_a_batch_pads_to_a_length_already_met():
    from tpu_utility.data.buckets import Bucketed, Settle

    def batch(n, pad_to):  # a collate's batch of rows up to n long, bucketed to pad_to
        ids = torch.full((2, pad_to), 7)
        ids[:, n:] = 0
        mask = (ids != 0).long()
        fills = {"input_ids": torch.tensor(0), "attention_mask": torch.tensor(0)}
        return Bucketed(({"input_ids": ids, "attention_mask": mask}, torch.tensor([True, True])), (0,), fills)

    settle = Settle()
    settle.first_epoch = True
    assert [settle(batch(n, b))[0]["input_ids"].shape[1] for n, b in ((30, 32), (45, 48))] == [32, 48]
    settle.first_epoch = False
    lengths = [settle(batch(n, b))[0]["input_ids"].shape[1] for n, b in ((20, 24), (40, 48), (60, 64), (50, 64))]
    assert lengths == [32, 48, 64, 64]  # 24 was never met: the next met, 32; 64 is longer than all
    out, valid = settle(batch(10, 16))
    assert torch.equal(out["attention_mask"].sum(1), torch.tensor([10, 10])) and out["input_ids"].shape == (2, 32)
    assert (out["input_ids"][:, 10:] == 0).all() and valid.tolist() == [True, True]


def test_seq2seq_labels_that_do_not_line_up_with_the_inputs_are_left_as_the_collate_made_them():
    # The longest label row (20) is as long as the longest input row by chance: the labels
    # were padded to their own longest, with -100, and under the inputs' padding they hold
    # real tokens. Before, the bucket (24) padded them with one of those tokens, and a
    # BART's loss was 4.278 where plain CPU torch, on the collate's own batch, gives 4.234.
    from transformers import BartConfig, BartForConditionalGeneration, DataCollatorForSeq2Seq
    tok = hf_fns.make_tokenizer()
    rows = [{"input_ids": list(range(4, 4 + n)), "labels": list(range(30, 30 + m))}
            for n, m in ((5, 20), (20, 3), (12, 8))]
    torch.manual_seed(0)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)).eval()
    collate = DataCollatorForSeq2Seq(tok, model=model)
    (batch,) = batches(tu.make_loader(rows, 3, train=False, num_workers=0, collate_fn=collate))
    exact = collate(rows)
    assert batch["input_ids"].shape == (3, 24) and exact["input_ids"].shape == (3, 20)
    assert torch.equal(batch["labels"], exact["labels"])
    assert torch.equal(batch["decoder_input_ids"], exact["decoder_input_ids"])
    with torch.no_grad():
        ours, plain = model(**batch).loss, model(**exact).loss
    assert torch.allclose(ours, plain, atol=1e-6), (ours, plain)


def test_text_is_never_padded_past_the_positions_of_the_model_it_feeds(run_script):
    # A BERT of 44 positions, a tokenizer with no limit (transformers' 1e30), texts of 4-44
    # tokens: plain CPU torch runs them. Before, a batch of 33-44 columns was padded to the
    # bucket 48 and the user's own loop failed in the model with "The expanded size of the
    # tensor (48) must match the existing size (44)". make_loader now finds the model's
    # limit in the replica that trains, and pads to 44 at most.
    r = run_script("""
        import functools, json
        import tpu_utility as tu, hf_fns

        if __name__ == "__main__":
            kw = dict(epochs=1, n=64, positions=44, limit=None)
            loop = functools.partial(hf_fns.ragged_loop, batch_size=16, **kw)
            out = tu.run(loop, cores=1, start_method="fork")
            ref = hf_fns.reference_ragged(global_batch=16, **kw)
            print("RESULT", json.dumps({"out": out, "ref": ref}))
    """, timeout=200).result
    out, ref = r["out"], r["ref"]
    assert max(ref["lengths"]) > 32, ref  # a batch the ladder would pad to 48
    assert max(out["lengths"]) == 44 and set(out["lengths"]) <= {16, 24, 32, 44}, out
    assert max(abs(a - b) for a, b in zip(out["losses"], ref["losses"])) < 1e-5, r
