"""The shard stage on chat records (train.task sft): each document is a conversation's templated ids, with a
label file aligned with the .bin; cut and dropped conversations are counted; bad records are file:line under
sharding.on_error; the settings hash covers style, template and seq_len; no labels at all is an error. The
trainer's ConversationRows reads the same conversations back as rows and targets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xxhash

from nightloom.chat import ChatRenderer, ChatSettings, to_messages
from nightloom.sharding import BadInputError, shard_dataset
from nightloom.sharding.prepare import plan_job
from nightloom.sharding.tokens import read_lengths
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from tests.support.chat import CHATML, CHATML_MARKED, as_record, build_chat_tokenizer, chat_messages, write_chats

STYLES = ("messages", "sharegpt", "alpaca")
try:
    from megatron.core.datasets import indexed_dataset as indexed
except ImportError:  # megatron-core is a dev dependency: the check below is skipped without it
    indexed = None


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat") / "tok")


def _chat(seq_len: int = 256, template: str = CHATML, style: str = "auto") -> ChatSettings:
    return ChatSettings(style=style, template=template, seq_len=seq_len)


def _shard(path, out, tokdir, chat, **kw):
    kw = {"num_shards": 2, "tolerance": 0.9, **kw}
    ds = DatasetSpec(path=str(path), style=kw.pop("style", "auto"))
    return shard_dataset(ds, ShardingSpec(output=str(out), **kw), tokenizer=TokenizerSpec(path=str(tokdir)), chat=chat)


def _mixed(tmp_path, n=24, seed=0, long_every=0):
    """A JSONL of `n` conversations in the three styles (alpaca for one-turn ones), one per line."""
    convs = chat_messages(n, seed=seed, long_every=long_every)
    lines = []
    for i, c in enumerate(convs):
        one_turn = sum(m["role"] == "assistant" for m in c) == 1
        style = STYLES[i % 3] if one_turn or STYLES[i % 3] != "alpaca" else "messages"
        lines.append(json.dumps(as_record(c, style)))
    p = tmp_path / "chats.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p, convs


def _documents(out, info):
    tf = info.token_files
    ids = np.fromfile(out / tf.bin, dtype=np.dtype(tf.dtype))
    labels = np.fromfile(out / tf.labels, dtype=np.uint8)
    lengths = read_lengths((out / tf.idx).read_bytes())
    starts = np.cumsum(lengths) - lengths
    return [(ids[a : a + n].tolist(), labels[a : a + n].tolist()) for a, n in zip(starts, lengths)], ids, labels


def test_each_document_is_a_conversation_with_aligned_labels(tmp_path, tokdir):
    import pyarrow.parquet as pq

    path, convs = _mixed(tmp_path, long_every=5)
    chat = _chat(seq_len=80)
    m = _shard(path, tmp_path / "out", tokdir, chat, heldout=3)
    render = ChatRenderer(tokdir, CHATML, seq_len=80)
    want = {}
    for c in convs:
        conv = render.render(c)
        if conv is not None:
            want[conv.text] = conv
    assert m.chat.cut == sum(w.cut for w in want.values()) > 0
    assert m.chat.dropped == len(convs) - len(want) > 0
    assert m.chat.template == chat.template_id and m.chat.seq_len == 80 and m.chat.style == "auto"
    seen = 0
    for info in [*m.shards, m.heldout]:
        docs, ids, labels = _documents(tmp_path / "out", info)
        texts = pq.read_table(tmp_path / "out" / info.path).column("text").to_pylist()
        assert len(docs) == len(texts) == info.rows == info.token_files.documents
        for text, (doc_ids, doc_labels) in zip(texts, docs):
            assert (doc_ids, doc_labels) == (want[text].ids, want[text].labels)
            assert len(doc_ids) <= 81
        tf = info.token_files
        assert len(ids) == len(labels) == tf.tokens == info.tokens  # no EOS appended: ChatML ends with <|im_end|>
        assert tf.label_tokens == int(labels.sum()) and tf.labels == tf.bin.replace(".bin", ".labels.bin")
        assert tf.labels_hash == "xxh3-128:" + xxhash.xxh3_128((tmp_path / "out" / tf.labels).read_bytes()).hexdigest()
        assert tf.labels in info.files()
        seen += info.rows
        if indexed is not None:  # Megatron reads the same conversations (one sequence each, no EOS added)
            ds = indexed.IndexedDataset(str(tmp_path / "out" / tf.prefix))
            assert [ds[i].tolist() for i in range(len(ds))] == [d[0] for d in docs]
    assert seen == len(want)
    assert m.chat.label_tokens == sum(i.token_files.label_tokens for i in m.shards)
    assert m.tokens == sum(i.tokens for i in m.shards)  # balanced on templated tokens


def test_same_bytes_for_any_worker_count_and_duplicates_dropped(tmp_path, tokdir):
    path, convs = _mixed(tmp_path, n=12)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + lines[:3]) + "\n")
    ds = DatasetSpec(path=str(path))
    tok = TokenizerSpec(path=str(tokdir))
    a = shard_dataset(
        ds,
        ShardingSpec(output=str(tmp_path / "a"), num_shards=2, tolerance=0.9),
        workers=1,
        tokenizer=tok,
        chat=_chat(),
    )
    b = shard_dataset(
        ds,
        ShardingSpec(output=str(tmp_path / "b"), num_shards=2, tolerance=0.9),
        workers=2,
        tokenizer=tok,
        chat=_chat(),
    )
    assert a.to_json() == b.to_json() and a.dedup_dropped == 3 and a.rows == 12
    for f in sorted(p.name for p in (tmp_path / "a").iterdir() if p.is_file()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_bad_records_are_reported_as_file_line_under_on_error(tmp_path, tokdir):
    path, _ = _mixed(tmp_path, n=30)
    lines = path.read_text().splitlines()
    lines.insert(4, json.dumps({"messages": [{"role": "bot", "content": "hi"}]}))  # line 5
    lines.insert(9, json.dumps({"messages": [{"role": "user", "content": "only a question"}]}))  # line 10
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInputError, match=r"chats.jsonl:5: messages\[0\].role: unknown role 'bot'"):
        _shard(path, tmp_path / "fail", tokdir, _chat())
    m = _shard(path, tmp_path / "skip", tokdir, _chat(), on_error="skip", max_bad_fraction=0.1)
    assert m.bad_records == 2 and m.rows == 30
    assert [(b.file, b.line) for b in m.bad_examples] == [("chats.jsonl", 5), ("chats.jsonl", 10)]
    assert "no assistant turn" in m.bad_examples[1].reason


def test_parquet_chat_rows_and_their_row_numbers(tmp_path, tokdir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = chat_messages(10, seed=2)
    rows = [as_record(c, "messages") for c in convs]
    rows[6] = {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    with pytest.raises(BadInputError, match=r"chats.parquet:7: messages\[0\].content: expected a string, got null"):
        _shard(tmp_path / "chats.parquet", tmp_path / "out", tokdir, _chat())
    del rows[6]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    assert _shard(tmp_path / "chats.parquet", tmp_path / "out", tokdir, _chat()).rows == 9


def test_the_settings_hash_covers_style_template_and_seq_len(tmp_path, tokdir):
    path, _ = _mixed(tmp_path, n=6)
    tok = TokenizerSpec(path=str(tokdir))

    def shash(chat, style="auto"):
        ds = DatasetSpec(path=str(path), style=style)
        return plan_job(ds, ShardingSpec(output=str(tmp_path / "o")), tokenizer=tok, chat=chat).settings_hash

    base = shash(_chat())
    others = {
        shash(_chat(seq_len=128)),
        shash(_chat(template=CHATML_MARKED)),
        shash(_chat(style="messages"), "messages"),
    }
    assert base not in others and len(others) == 3
    plain = plan_job(DatasetSpec(path=str(path)), ShardingSpec(output=str(tmp_path / "o")), tokenizer=tok).settings_hash
    assert plain != base  # pretraining the same file: another dataset (and its hash keeps no chat key)
    with pytest.raises(BadInputError, match="dataset.style: messages records are chats"):
        plan_job(DatasetSpec(path=str(path), style="messages"), ShardingSpec(output=str(tmp_path / "o")), tokenizer=tok)


def test_no_label_token_at_all_is_an_error(tmp_path, tokdir):
    path, _ = _mixed(tmp_path, n=6)
    with pytest.raises(
        BadInputError, match=r"zero documents .* 6 conversations dropped as longer than seq_len \+ 1 = 9"
    ):
        _shard(path, tmp_path / "out", tokdir, _chat(seq_len=8))
    # kept conversations whose labels are all cut away cannot exist (a cut keeps an assistant turn), so the
    # publish step's own check (no label token in the training shards) is reached only by a heldout-only corpus


def test_conversation_rows_give_targets_only_where_the_next_id_is_a_label(tmp_path, tokdir):
    from nightloom.tokenizer import load_tokenizer
    from nightloom.train.data import IGNORE_INDEX, ConversationRows, DataError, PackedWindows, read_eval_rows

    convs = chat_messages(10, seed=5)
    write_chats(tmp_path / "chats.jsonl", convs)
    m = _shard(tmp_path / "chats.jsonl", tmp_path / "out", tokdir, _chat(), heldout=2)
    rows = ConversationRows(str(tmp_path / "out"), 256, seed=3, tokenizer=TokenizerSpec(path=str(tokdir)))
    assert rows.total == m.rows == 8
    render = ChatRenderer(tokdir, CHATML)
    by_ids = {tuple(c.ids): c for c in (render.render(to_messages({"messages": c})) for c in convs)}
    ids, labels = rows.rows(0, 8)
    x, y = rows.sequences(0, 8)
    assert x.shape == y.shape == (8, 256) and ids.shape == (8, 257)
    eos = load_tokenizer(TokenizerSpec(path=str(tokdir))).eos_id
    for j in range(8):
        conv = next(c for k, c in by_ids.items() if list(k) == ids[j, : len(k)].tolist())
        n = len(conv.ids)
        assert labels[j, :n].tolist() == conv.labels and not labels[j, n:].any() and (ids[j, n:] == eos).all()
        want = [t if lab else IGNORE_INDEX for t, lab in zip(conv.ids[1:], conv.labels[1:])]
        assert x[j].tolist() == ids[j, :-1].tolist()
        assert y[j, : n - 1].tolist() == want and (y[j, n - 1 :] == IGNORE_INDEX).all()
    assert {tuple(r) for r in x.tolist()} == {tuple(r) for r in rows.sequences(8, 8)[0].tolist()}  # epochs wrap
    where, ex, ey = read_eval_rows(
        str(tmp_path / "out"), None, load_tokenizer(TokenizerSpec(path=str(tokdir))), 256, 16
    )
    assert where.endswith(m.heldout.token_files.bin) and ex.shape == (2, 256)
    assert int((ey != IGNORE_INDEX).sum()) == m.heldout.token_files.label_tokens
    with pytest.raises(DataError, match="a chat dataset .*: set train.task: sft"):
        PackedWindows(str(tmp_path / "out"), 256, tokenizer=TokenizerSpec(path=str(tokdir)))
