#!/usr/bin/env node
// Builds every tokenizer file of kvslim with Hugging Face `tokenizers` 0.23.2 (the Rust
// library, through its official Node binding from npm) and writes the golden id lists.
//
//   node training/node/build_tokenizers.js <repo root>
//
// Writes:
//   models/tiny/tokenizer.json                 byte-level BPE, vocab 4096, <|bos|> <|eos|> <|pad|>
//   tests/golden/tokenizers/llama3_style.json  ~1000 vocab, Llama-3 regex, ignore_merges, "a b" merges
//   tests/golden/tokenizers/qwen2_style.json   ~1000 vocab, NFC, Qwen2 regex (\p{N} single digits),
//                                              ChatML specials, no BOS, [a, b] pair merges
//   tests/golden/tokenizers/golden_ids.json    ids of hard strings for the three tokenizers
//
// BPE training: the binding's Tokenizer.train() runs HF's BpeTrainer with its default
// settings (30000 tokens). BPE training is greedy and sequential, so the first k merges
// of that run are exactly what a k-merge run produces; we keep the first k and rebuild
// the vocab as [specials][256 byte symbols][merge results in merge order].
'use strict';
const fs = require('fs');
const path = require('path');
const tk = require('tokenizers');

const root = path.resolve(process.argv[2] || path.join(__dirname, '..', '..'));
const LLAMA3_SPLIT = String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
const QWEN2_SPLIT = String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;

const CAFE_NFC = 'Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m Zo\u00eb'.normalize('NFC');
const HARD_STRINGS = [
  'Hello world! This is a plain English sentence.',
  '   leading spaces',
  'trailing spaces   ',
  'multiple     spaces   between  words',
  '\ttabs\tand\t\ttabs\t',
  'line one\r\nline two\r\n\r\nline four',
  '\n\nnewlines only at the start and end\n\n\n',
  '   ',
  '1234567',
  'Call 555-0100 or +1 (212) 736 5000; pi is 3.14159 and 1,000,000 > 999.',
  "I'm don't THEY'LL we've she'd it's You'RE",
  CAFE_NFC,
  CAFE_NFC.normalize('NFD'),
  'emoji \u{1F600} thumbs \u{1F44D}\u{1F3FD} family \u{1F468}\u200D\u{1F469}\u200D\u{1F467}\u200D\u{1F466} flag \u{1F1EB}\u{1F1F7} heart \u2764\uFE0F',
  '\u4e2d\u6587\u5b57\u7b26\u6d4b\u8bd5\uff0c\u4f60\u597d\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8',
  '\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 123',
  '<|begin_of_text|>Hello<|eot_id|> world<|end_of_text|>',
  '<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n',
  '<|bos|>In the beginning<|eos|>',
  'The kvslim zyxwvut cache.',
  'supercalifragilisticexpialidocious antidisestablishmentarianism',
  'mixed\u00a0non-breaking\u2009thin\u3000ideographic spaces',
  '',
];

function byteLevelAlphabet() {
  // GPT-2 bytes_to_unicode order: printable bytes map to themselves, the rest to 256+n.
  const bs = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; b++) if (!bs.includes(b)) { bs.push(b); cs.push(256 + n); n++; }
  const map = new Array(256);
  bs.forEach((b, i) => { map[b] = String.fromCodePoint(cs[i]); });
  return map;  // map[byte] = symbol; index order = byte value
}

function baseSpec(splitRegex, normalizer) {
  return {
    version: '1.0', truncation: null, padding: null, added_tokens: [], normalizer,
    pre_tokenizer: {type: 'Sequence', pretokenizers: [
      {type: 'Split', pattern: {Regex: splitRegex}, behavior: 'Isolated', invert: false},
      {type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false}]},
    post_processor: null,
    decoder: {type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true},
    model: {type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
            end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: false,
            vocab: {}, merges: []},
  };
}

// Trains on `files` and returns the first `nMerges` merges as [a, b] pairs.
function trainMerges(spec, files, nMerges) {
  const t = tk.Tokenizer.fromString(JSON.stringify(spec));
  t.train(files);
  const tmp = path.join(require('os').tmpdir(), `kvslim_bpe_${process.pid}.json`);
  t.save(tmp, false);
  const trained = JSON.parse(fs.readFileSync(tmp, 'utf8'));
  fs.unlinkSync(tmp);
  const merges = trained.model.merges.map(m => (typeof m === 'string' ? m.split(' ') : m));
  if (merges.length < nMerges) throw new Error(`only ${merges.length} merges trained, need ${nMerges}`);
  return merges.slice(0, nMerges);
}

// vocab = [specialsFirst][256 byte symbols][merge results]; returns {vocab, merges}.
function buildVocab(merges, specialsFirst, extraWords) {
  const vocab = {};
  let id = 0;
  for (const s of specialsFirst) vocab[s] = id++;
  for (const sym of byteLevelAlphabet()) vocab[sym] = id++;
  for (const [a, b] of merges) {
    if (!(a in vocab) || !(b in vocab)) throw new Error(`merge ${a} ${b} uses an unknown symbol`);
    if (!((a + b) in vocab)) vocab[a + b] = id++;
  }
  for (const w of extraWords || []) {
    if (w in vocab) throw new Error(`${w} already in vocab`);
    vocab[w] = id++;
  }
  return vocab;
}

function addedToken(id, content) {
  return {id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true};
}

function writeJson(file, obj) {
  fs.mkdirSync(path.dirname(file), {recursive: true});
  fs.writeFileSync(file, JSON.stringify(obj, null, 1) + '\n');
}

function sampleFile(trainTxt, out, maxBytes) {
  // Every 8th block of 64 lines from the training text, up to maxBytes.
  const lines = fs.readFileSync(trainTxt, 'utf8').split('\n');
  const picked = [];
  let size = 0;
  for (let i = 0; i < lines.length && size < maxBytes; i++) {
    if (Math.floor(i / 64) % 8 !== 0) continue;
    picked.push(lines[i]);
    size += Buffer.byteLength(lines[i]) + 1;
  }
  fs.writeFileSync(out, picked.join('\n') + '\n');
}

async function cases(tokFile) {
  const t = tk.Tokenizer.fromFile(tokFile);
  const out = [];
  for (const text of HARD_STRINGS) {
    const withSp = await t.encode(text, null, {addSpecialTokens: true});
    const noSp = await t.encode(text, null, {addSpecialTokens: false});
    out.push({text, ids: withSp.getIds(), ids_no_special: noSp.getIds(), tokens_no_special: noSp.getTokens(),
              decoded_no_special: await t.decode(noSp.getIds(), false)});
  }
  return {vocab_size: t.getVocabSize(true), cases: out};
}

async function main() {
  const data = path.join(root, 'training', 'data');
  const trainTxt = path.join(data, 'train.txt');
  const gdir = path.join(root, 'tests', 'golden', 'tokenizers');
  const tinyFile = path.join(root, 'models', 'tiny', 'tokenizer.json');
  const only = process.argv[3] || 'all';

  if (only === 'all' || only === 'tiny') {
    // Tiny model: specials 0..2, then 256 bytes, then 3837 merges = 4096.
    const specials = ['<|bos|>', '<|eos|>', '<|pad|>'];
    const spec = baseSpec(LLAMA3_SPLIT, null);
    console.time('train tiny');
    const merges = trainMerges(spec, [trainTxt], 4096 - specials.length - 256);
    console.timeEnd('train tiny');
    spec.model.vocab = buildVocab(merges, specials);
    spec.model.merges = merges;
    spec.added_tokens = specials.map((s, i) => addedToken(i, s));
    spec.post_processor = {type: 'TemplateProcessing',
      single: [{SpecialToken: {id: '<|bos|>', type_id: 0}}, {Sequence: {id: 'A', type_id: 0}}],
      pair: [{SpecialToken: {id: '<|bos|>', type_id: 0}}, {Sequence: {id: 'A', type_id: 0}},
             {SpecialToken: {id: '<|bos|>', type_id: 1}}, {Sequence: {id: 'B', type_id: 1}}],
      special_tokens: {'<|bos|>': {id: '<|bos|>', ids: [0], tokens: ['<|bos|>']}}};
    if (Object.keys(spec.model.vocab).length !== 4096) throw new Error('tiny vocab is not 4096');
    writeJson(tinyFile, spec);
  }
  if (only === 'all' || only === 'golden') {
    const sample = path.join(require('os').tmpdir(), `kvslim_sample_${process.pid}.txt`);
    sampleFile(trainTxt, sample, 2000000);
    // Llama-3 style: specials at the END of the vocab (as in Llama-3), legacy "a b" merges,
    // ignore_merges with two whole-word entries that no merge builds.
    {
      const spec = baseSpec(LLAMA3_SPLIT, null);
      const merges = trainMerges(spec, [sample], 1000 - 256);
      spec.model.vocab = buildVocab(merges, [], ['\u0120kvslim', '\u0120zyxwvut']);
      spec.model.merges = merges.map(([a, b]) => `${a} ${b}`);
      spec.model.ignore_merges = true;
      const specials = ['<|begin_of_text|>', '<|end_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>'];
      let next = Object.keys(spec.model.vocab).length;
      spec.added_tokens = specials.map(s => addedToken(next++, s));
      const bos = spec.added_tokens[0].id;
      spec.post_processor = {type: 'Sequence', processors: [
        {type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true},
        {type: 'TemplateProcessing',
         single: [{SpecialToken: {id: '<|begin_of_text|>', type_id: 0}}, {Sequence: {id: 'A', type_id: 0}}],
         pair: [{SpecialToken: {id: '<|begin_of_text|>', type_id: 0}}, {Sequence: {id: 'A', type_id: 0}},
                {SpecialToken: {id: '<|begin_of_text|>', type_id: 1}}, {Sequence: {id: 'B', type_id: 1}}],
         special_tokens: {'<|begin_of_text|>': {id: '<|begin_of_text|>', ids: [bos], tokens: ['<|begin_of_text|>']}}}]};
      writeJson(path.join(gdir, 'llama3_style.json'), spec);
    }
    // Qwen2 style: NFC, single-digit regex, ChatML specials after the vocab, no BOS, pair merges.
    {
      const spec = baseSpec(QWEN2_SPLIT, {type: 'NFC'});
      const merges = trainMerges(spec, [sample], 1000 - 256);
      spec.model.vocab = buildVocab(merges, []);
      spec.model.merges = merges;
      const specials = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'];
      let next = Object.keys(spec.model.vocab).length;
      spec.added_tokens = specials.map(s => addedToken(next++, s));
      spec.post_processor = {type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false};
      writeJson(path.join(gdir, 'qwen2_style.json'), spec);
    }
    fs.unlinkSync(sample);
    const golden = {producer: 'tokenizers 0.23.2 (Rust) via its Node binding', strings: HARD_STRINGS, tokenizers: {}};
    golden.tokenizers.llama3_style = {file: 'llama3_style.json', ...(await cases(path.join(gdir, 'llama3_style.json')))};
    golden.tokenizers.qwen2_style = {file: 'qwen2_style.json', ...(await cases(path.join(gdir, 'qwen2_style.json')))};
    golden.tokenizers.tiny = {file: '../../../models/tiny/tokenizer.json', ...(await cases(tinyFile))};
    writeJson(path.join(gdir, 'golden_ids.json'), golden);
    for (const [k, v] of Object.entries(golden.tokenizers)) console.log(`${k}: vocab ${v.vocab_size}`);
  }
}

main().catch(e => { console.error(e); process.exit(1); });
