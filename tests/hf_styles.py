"""Two tokenizer styles the families ship, trained here on a few lines (nothing is
downloaded), each with transformers' PreTrainedTokenizerFast over the same tokenizer.json:
- Qwen2's byte-level BPE (Qwen2.5 and Qwen3 ship the same): a regex split, the ByteLevel
  pre-tokenizer and decoder, and the ChatML specials <|endoftext|>, <|im_start|>,
  <|im_end|> added after the vocabulary;
- Mistral's (and Llama-2's) SentencePiece-style BPE: the Metaspace "▁", byte
  fallback to <0x00>..<0xFF> (ids 3..258, after <unk>, <s>, </s>), a post-processor that
  adds <s>, and the [INST] / tool control tokens as specials.
- Gemma's (gemma_tokenizer, outside STYLES: its template has no tool turns): spaces
  normalized to "▁" with no pre-tokenizer and no prefix space, byte fallback, <pad> <eos>
  <bos> <unk> first, <bos> added, <start_of_turn> / <end_of_turn> as specials.
"""

import json

import pytest
import transformers
from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

from training.tokenizer import HFTokenizer

CORPUS = [
    'The quick brown fox jumps over the lazy dog.',
    'What is the weather in Paris today? It is sunny and warm.',
    'Call the function get_weather with the city name.',
    'def add(a, b):\n    return a + b\n',
    'Numbers: 12345, 67.89 and 3 apples; the user asked twice.',
    'You are a helpful assistant. Answer the question briefly.',
] * 4
# Outside the training text: accents, CJK, emoji (4-byte UTF-8, one with a joiner).
UNSEEN = 'Ünïcödé: 東京の天気は? 🌤️ weather 👩‍💻 naïve café\t\ttabs  two spaces'

CHATML = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
MISTRAL = ['<unk>', '<s>', '</s>']
MISTRAL_CONTROL = ['[INST]', '[/INST]', '[TOOL_CALLS]', '[AVAILABLE_TOOLS]',
                   '[/AVAILABLE_TOOLS]', '[TOOL_RESULTS]', '[/TOOL_RESULTS]']
# Qwen2's split: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, whitespace.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def qwen_tokenizer() -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior='isolated'),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.add_special_tokens(CHATML)   # after the vocabulary, as Qwen's are
  return tok


def mistral_tokenizer() -> Tokenizer:
  """Merges trained with Metaspace words, then the model rebuilt as Mistral's
  tokenizer.json lays it out: <unk> <s> </s>, the 256 byte tokens, the pieces."""
  metaspace = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first')
  trained = Tokenizer(models.BPE(unk_token='<unk>'))
  trained.pre_tokenizer = metaspace
  trained.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=200, special_tokens=MISTRAL, show_progress=False))
  learned = json.loads(trained.to_str())['model']
  pieces = sorted((i, t) for t, i in learned['vocab'].items() if t not in MISTRAL)
  vocab = MISTRAL + [f'<0x{b:02X}>' for b in range(256)] + [t for _, t in pieces]
  merges = [tuple(m.split(' ')) if isinstance(m, str) else tuple(m)
            for m in learned['merges']]
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token='<unk>',
                             byte_fallback=True, fuse_unk=True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first',
                                               split=False)
  tok.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(' ', 1, 0)])
  tok.post_processor = processors.TemplateProcessing(
      single='<s> $A', pair='<s> $A <s> $B', special_tokens=[('<s>', 1)])
  tok.add_special_tokens(MISTRAL + MISTRAL_CONTROL)
  return tok


GEMMA = ['<pad>', '<eos>', '<bos>', '<unk>']
GEMMA_CONTROL = ['<start_of_turn>', '<end_of_turn>']


def gemma_tokenizer() -> Tokenizer:
  """Merges trained on "▁"-joined words, then the model laid out as Gemma's
  tokenizer.json is: the four specials, the turn tokens, the 256 byte tokens, the pieces."""
  trained = Tokenizer(models.BPE(unk_token='<unk>'))
  trained.normalizer = normalizers.Replace(' ', '▁')
  trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='never')
  trained.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=200, special_tokens=GEMMA, show_progress=False))
  learned = json.loads(trained.to_str())['model']
  pieces = sorted((i, t) for t, i in learned['vocab'].items() if t not in GEMMA)
  vocab = GEMMA + GEMMA_CONTROL + [f'<0x{b:02X}>' for b in range(256)] + [t for _, t in pieces]
  merges = [tuple(m.split(' ')) if isinstance(m, str) else tuple(m)
            for m in learned['merges']]
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token='<unk>',
                             byte_fallback=True, fuse_unk=True))
  tok.normalizer = normalizers.Replace(' ', '▁')
  tok.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(),
                                   decoders.Fuse()])
  tok.post_processor = processors.TemplateProcessing(
      single='<bos> $A', pair='<bos> $A <bos> $B', special_tokens=[('<bos>', 2)])
  tok.add_special_tokens(GEMMA + GEMMA_CONTROL)
  return tok


GEMMA_SPECIALS = dict(bos_token='<bos>', eos_token='<eos>', unk_token='<unk>',
                      pad_token='<pad>')

STYLES = {
    'qwen': (qwen_tokenizer, dict(eos_token='<|im_end|>', pad_token='<|endoftext|>')),
    'mistral': (mistral_tokenizer, dict(bos_token='<s>', eos_token='</s>',
                                        unk_token='<unk>')),
}


@pytest.fixture(scope='module', params=STYLES)
def style(request, tmp_path_factory):
  """(name, meshlm's HFTokenizer, transformers' tokenizer) over one tokenizer.json."""
  path = tmp_path_factory.mktemp(request.param) / 'tokenizer.json'
  build, specials = STYLES[request.param]
  build().save(str(path))
  return (request.param, HFTokenizer(str(path)),
          transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), **specials))

