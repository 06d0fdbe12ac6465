"""GuardError as users meet it: pickles, reprs, and never prints tensor contents."""
import pickle
import re

import pytest
import torch

from guardlint.guard import (GuardError, clear_cache, guard_cudnn_vision, guard_lora, guard_varlen, mode,
                             prepare_varlen_metadata)

MARK = 987654321  # a value that must never show up in a message


@guard_varlen
def varlen_attention(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None, metadata=None):
    return max_seqlen


@guard_cudnn_vision
def cudnn_vision_attention(q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, forward_metadata=None,
                           **kwargs):
    return forward_metadata


@guard_lora
def shrink(x, weights, batch_info):
    return batch_info


class Info:
    def __init__(self, **fields):
        self.__dict__.update(dict(use_cuda_graph=False, bs=2, num_segments=2, weight_indices=None,
                                  lora_ranks=None, scalings=None, max_len=None, seg_lens=None,
                                  permutation=None), **fields)


def raised(fn):
    with pytest.raises(GuardError) as info:
        fn()
    return info.value


def test_guard_error_pickles_with_everything():
    q = torch.randn(12, 2, 4)
    err = raised(lambda: varlen_attention(q, q, q, torch.tensor([0, 5, 11])))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is GuardError and str(back) == str(err)
    for field in ("code", "argument", "expected", "got", "function", "fix", "name"):
        assert getattr(back, field) == getattr(err, field)
    assert isinstance(back, ValueError) and isinstance(back, RuntimeError)
    assert repr(back).startswith("GuardError(") and "GL103" in repr(back)


def test_guard_error_message_shape():
    q = torch.randn(12, 2, 4)
    err = raised(lambda: varlen_attention(q, q, q, None))
    text = str(err)
    assert text.startswith("[GL101 missing-sequence-lengths] varlen_attention(): argument 'sequence_lengths'")
    assert "fix: " in text and "see: guardlint explain GL101" in text


def marked_failures():
    """Calls that fail on a tensor holding MARK (or data derived from it)."""
    q = torch.randn(12, 2, 4)
    q0 = torch.randn(0, 2, 4)
    cases = [
        lambda: varlen_attention(q, q, q, torch.tensor([0, MARK, 12])),
        lambda: varlen_attention(q, q, q, torch.tensor([0, 5, MARK])),
        lambda: varlen_attention(q, q, q, torch.tensor([MARK, 5, 12])),
        lambda: prepare_varlen_metadata([0, MARK], q, layout="cudnn"),
        lambda: prepare_varlen_metadata(torch.tensor([0, 5, MARK]) * 3, q, layout="cudnn"),
        lambda: cudnn_vision_attention(q0, q0, q0, torch.tensor([0, MARK]), 1, 0),
        lambda: shrink(torch.randn(7, 3), torch.randn(2, 4, 3), Info(seg_indptr=torch.tensor([0, MARK, 7]))),
    ]
    strict = [
        lambda: varlen_attention(q, q, q, torch.tensor([0, 5, 12]), sequence_lengths=torch.tensor([5, MARK]),
                                 max_seqlen=7),
        lambda: varlen_attention(q, q, q, torch.tensor([0, 5, 12]), sequence_lengths=torch.tensor([MARK, 7]),
                                 max_seqlen=7),
        lambda: shrink(torch.randn(7, 3), torch.randn(2, 4, 3),
                       Info(seg_indptr=torch.tensor([0, 3, 7]), seg_lens=torch.tensor([3, MARK]))),
        lambda: shrink(torch.randn(7, 3), torch.randn(2, 4, 3),
                       Info(seg_indptr=torch.tensor([0, 3, 7]), max_len=4,
                            weight_indices=torch.tensor([0, MARK], dtype=torch.int32))),
    ]
    return cases, strict


# MARK or any value derived from it (a sum, a difference, a multiple): seven digits or more
LEAK = re.compile(r"\d{7,}")


def assert_no_values(err: GuardError):
    for text in (str(err), repr(err), str(err.got), str(err.expected), str(err.fix)):
        assert not LEAK.search(text), text
    assert err.argument and err.argument in str(err), str(err)   # the message names what was wrong


def test_the_leak_check_sees_printed_and_derived_values():
    """The check below can fail: a tensor's text and values derived from MARK are caught."""
    t = torch.tensor([0, 5, MARK])
    for leaked in (str(t), repr(t * 3), f"got {t[1:] - t[:-1]}", str(int(t.max()))):
        assert LEAK.search(leaked), leaked
    err = GuardError("GL103", argument="cu_seqlens", expected="a prefix sum", got=str(t))
    with pytest.raises(AssertionError):
        assert_no_values(err)


def test_messages_never_print_tensor_values():
    clear_cache()
    cases, strict = marked_failures()
    for case in cases:
        assert_no_values(raised(case))
    with mode("strict"):
        for case in strict:
            assert_no_values(raised(case))


def test_messages_give_shapes_dtypes_and_devices():
    q = torch.randn(12, 2, 4)
    err = raised(lambda: varlen_attention(q, q, q, torch.tensor([[0, 5, 12]])))
    assert "shape=(1, 3)" in str(err) and "torch.int64" in str(err) and "cpu" in str(err)
