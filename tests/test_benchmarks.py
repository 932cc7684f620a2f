"""The GPU benchmark scripts run end to end (CPU smoke mode: tiny shapes, interpret)."""

import math

import pytest

from benchmarks import attention, paged_decode


def test_attention_benchmark_smoke():
  rows = attention.main(['--smoke'])
  assert {r['impl'] for r in rows} == {'pallas', 'xla'}
  assert all('error' not in r and math.isfinite(r['fwd_tflops']) for r in rows), rows


def test_paged_decode_benchmark_smoke():
  rows = paged_decode.main(['--smoke'])
  assert len(rows) == 2
  assert all(r['bandwidth_gbs'] > 0 and math.isfinite(r['fraction_of_copy']) for r in rows)


def test_attention_tile_sweep_smoke():
  rows = attention.main(['--smoke', '--tiles'])
  assert [r['tiles']['block_k_bwd'] for r in rows] == [16]
  assert all('error' not in r and math.isfinite(r['bwd_tflops']) for r in rows), rows


def test_attention_packed_documents_smoke():
  rows = attention.main(['--smoke', '--packed'])
  assert [(r['impl'], r['doc_len']) for r in rows] == [('pallas', 64), ('pallas', 16)]
  assert all('error' not in r and math.isfinite(r['bwd_vs_one_doc']) for r in rows), rows
  one_doc, packed = rows
  for key in ('fwd', 'bwd'):   # the ratios are the one-document row's time over this row's
    ratio = one_doc[f'{key}_ms'] / packed[f'{key}_ms']
    assert packed[f'{key}_vs_one_doc'] == pytest.approx(ratio)
  # Useful FLOPs count each document's own causal half: 4 b hq d t doc_len / 2 (b=1,
  # hq=4, d=32, t=64), not the whole row's triangle.
  for r in rows:
    useful = 4 * 4 * 32 * 64 * r['doc_len'] / 2
    assert r['fwd_tflops'] * r['fwd_ms'] * 1e9 == pytest.approx(useful)


def test_paged_decode_tile_sweep_smoke():
  rows = paged_decode.main(['--smoke', '--tiles'])
  assert [r['tiles'] for r in rows] == [dict(pages_per_block=2, num_warps=4, num_stages=2)]
  assert rows[0]['bandwidth_gbs'] > 0
