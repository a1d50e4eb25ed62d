'use strict';
// A deterministic generator in place of a model: the same group id, sample and seed give the
// same tokens, log-probs and rewards on every run, so a test can tell a result dispatched
// twice from two results. What it returns has the shape and dtypes an engine's must have
// (rollout.proto Sequence): int32 token ids, float32 log-probs, uint8 loss mask and int64
// weight versions, all of the full length T, prompt included.

const crypto = require('crypto');

const VOCAB = 256; // generated token ids are below this (--vocab: the model's vocabulary)
const MAX_TOKENS = 16; // generated per sequence when --tokens is 0 (hashed lengths)

// A xorshift32 stream seeded from a digest of `key`.
function stream(key) {
  let s = crypto.createHash('sha256').update(key).digest().readUInt32LE(0) || 1;
  return () => {
    s ^= s << 13;
    s >>>= 0;
    s ^= s >>> 17;
    s ^= s << 5;
    s >>>= 0;
    return s;
  };
}

// NDArray: little-endian bytes with dtype and shape (array.proto).
function ndarray(dtype, typed) {
  return {
    dtype,
    shape: [typed.length],
    data: Buffer.from(typed.buffer, typed.byteOffset, typed.byteLength),
  };
}

const INT_DTYPES = { int8: 1, int16: 2, int32: 4, int64: 8 };

// The prompt's token ids: Prompt.token_ids when set (any signed integer dtype), else the
// prompt text's UTF-8 bytes.
function promptTokens(prompt) {
  const arr = prompt && prompt.token_ids;
  if (arr && arr.dtype) {
    const size = INT_DTYPES[arr.dtype];
    const n = arr.data.length / size;
    const out = new Int32Array(n);
    for (let i = 0; i < n; i++) {
      const off = i * size;
      out[i] =
        size === 1
          ? arr.data.readInt8(off)
          : size === 2
            ? arr.data.readInt16LE(off)
            : size === 4
              ? arr.data.readInt32LE(off)
              : Number(arr.data.readBigInt64LE(off));
    }
    return out;
  }
  return Int32Array.from(Buffer.from((prompt && prompt.text) || '', 'utf8'));
}

// One sequence of `policy` for sample `index` of `group`, generated at weight `version`.
function sequence(group, index, policy, agentId, version, fixedTokens, vocab = VOCAB) {
  const sp = group.sampling_params || {};
  const next = stream(`${group.group_id}/${index}/${policy}/${sp.seed || 0}`);
  const prompt = promptTokens(group.prompt);
  const limit = sp.max_new_tokens;
  const length = fixedTokens > 0 ? Math.min(fixedTokens, limit) : 1 + (next() % Math.min(limit, MAX_TOKENS));
  const p = prompt.length;
  const t = p + length;
  const tokens = new Int32Array(t);
  const logprobs = new Float32Array(t);
  const mask = new Uint8Array(t);
  const versions = new BigInt64Array(t).fill(-1n);
  tokens.set(prompt);
  for (let i = p; i < t; i++) {
    tokens[i] = next() % vocab;
    logprobs[i] = -(0.05 + (next() % 3000) / 1000); // negative and finite
    mask[i] = 1;
    versions[i] = BigInt(version);
  }
  const reward = next() % 2; // 0 or 1: groups of several samples are rarely all equal
  return {
    sequence: {
      policy_id: policy,
      agent_id: agentId,
      prompt_length: p,
      token_ids: ndarray('int32', tokens),
      logprobs: ndarray('float32', logprobs),
      loss_mask: ndarray('uint8', mask),
      weight_versions: ndarray('int64', versions),
      finish_reason: length === limit ? 'FINISH_REASON_LENGTH' : 'FINISH_REASON_STOP',
      reward,
    },
    bytes: t * (4 + 4 + 1 + 8),
  };
}

// The GroupResult of `group`: one trajectory per sample, one sequence per policy of the group
// (each tagged with its policy; agents named after them when there are several), the team
// reward the mean of the agents'. `versionOf(policy)` is the version held now.
function groupResult(group, instanceId, versionOf, fixedTokens, vocab = VOCAB) {
  const multi = group.policy_ids.length > 1;
  let bytes = 0;
  const trajectories = [];
  for (let i = 0; i < group.num_samples; i++) {
    const sequences = [];
    const agentRewards = {};
    for (const policy of group.policy_ids) {
      const agent = multi ? policy : '';
      const s = sequence(group, i, policy, agent, versionOf(policy), fixedTokens, vocab);
      sequences.push(s.sequence);
      bytes += s.bytes;
      if (multi) agentRewards[agent] = s.sequence.reward;
    }
    const reward = sequences.reduce((a, s) => a + s.reward, 0) / sequences.length;
    trajectories.push({
      trajectory_id: `${group.group_id}/${i}`,
      group_id: group.group_id,
      sample_index: i,
      sequences,
      reward,
      agent_rewards: agentRewards,
    });
  }
  return { result: { group_id: group.group_id, trajectories, instance_id: instanceId }, bytes };
}

module.exports = { groupResult, INT_DTYPES };
