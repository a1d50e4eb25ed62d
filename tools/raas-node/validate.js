'use strict';
// Request checks of rollout_service.proto and rollout.proto: each failure names the field,
// as INVALID_ARGUMENT with an ErrorInfo reason (INVALID_FIELD unless the contract names
// another) and a BadRequest.

const { INT_DTYPES } = require('./generator');

const MAX_GROUPS = 1024;
const MAX_IDS = 4096;
const MAX_COLLECT = 4096; // groups per CollectResults / CollectResultBatch
const MAX_WAIT_S = 30;
const MAX_SAMPLES = 1024;

class Invalid extends Error {
  constructor(field, message, reason = 'INVALID_FIELD') {
    super(`${field}: ${message}`);
    this.field = field;
    this.reason = reason;
  }
}

function checkString(value, field, min, max) {
  if (value.length < min || value.length > max) {
    throw new Invalid(field, `${value.length} characters, expected ${min}..${max}`);
  }
}

function checkIds(ids, field, min = 1) {
  if (ids.length < min || ids.length > MAX_IDS) {
    throw new Invalid(field, `${ids.length} ids, expected ${min}..${MAX_IDS}`);
  }
  ids.forEach((id, i) => checkString(id, `${field}[${i}]`, 1, 256));
}

// CollectResults' and CollectResultBatch's bounds: max_groups is required (0 is not a default).
function checkCollect(maxGroups, waitS) {
  if (maxGroups < 1 || maxGroups > MAX_COLLECT) {
    throw new Invalid('max_groups', `${maxGroups}, expected 1..${MAX_COLLECT}`);
  }
  if (!(waitS >= 0 && waitS <= MAX_WAIT_S)) {
    throw new Invalid('max_wait', `${waitS} s, at most ${MAX_WAIT_S} s`);
  }
}

// A version identity: 1-128 characters, one path segment, not "initial" (weight_service.proto).
function checkIdentity(id, field) {
  if (id.length < 1 || id.length > 128 || id === 'initial' || id === '.' || id === '..' || /[/\\\0]/.test(id)) {
    throw new Invalid(field, `${JSON.stringify(id)} is not a version identity`, 'INVALID_IDENTITY');
  }
}

function checkSampling(sp, where) {
  const t = sp.temperature;
  if (!Number.isFinite(t) || t < 0 || (t > 0 && t < 1e-4)) {
    throw new Invalid(`${where}.sampling_params.temperature`, `${t}: expected 0 or a finite value >= 1e-4`);
  }
  if (!(sp.top_p >= 0 && sp.top_p <= 1)) {
    throw new Invalid(`${where}.sampling_params.top_p`, `${sp.top_p}: expected (0, 1], or 0 for 1`);
  }
  if (sp.top_k < 0) throw new Invalid(`${where}.sampling_params.top_k`, `${sp.top_k} < 0`);
  if (sp.max_new_tokens < 1) {
    throw new Invalid(`${where}.sampling_params.max_new_tokens`, `${sp.max_new_tokens}: expected >= 1`);
  }
  if (sp.stop_strings.length > 64) throw new Invalid(`${where}.sampling_params.stop_strings`, 'more than 64');
  sp.stop_strings.forEach((s, i) => checkString(s, `${where}.sampling_params.stop_strings[${i}]`, 1, 1024));
  if (sp.stop_token_ids.length > 1024) throw new Invalid(`${where}.sampling_params.stop_token_ids`, 'more than 1024');
  if (sp.stop_token_ids.some((x) => x < 0)) throw new Invalid(`${where}.sampling_params.stop_token_ids`, 'negative id');
}

function checkPromptTokens(arr, field) {
  const size = INT_DTYPES[arr.dtype];
  if (!size) throw new Invalid(`${field}.dtype`, `${JSON.stringify(arr.dtype)}: expected a signed integer dtype`);
  if (arr.shape.length !== 1 || arr.shape[0] * size !== arr.data.length) {
    throw new Invalid(field, `shape ${JSON.stringify(arr.shape)} and ${arr.data.length} bytes: expected one dimension of data/itemsize`);
  }
}

// Checks a SubmitGroups request against what this instance serves.
function checkGroups(groups, served) {
  if (groups.length < 1 || groups.length > MAX_GROUPS) {
    throw new Invalid('groups', `${groups.length} groups, expected 1..${MAX_GROUPS}`);
  }
  const seen = new Set();
  groups.forEach((g, i) => {
    const where = `groups[${i}]`;
    checkString(g.group_id, `${where}.group_id`, 1, 256);
    if (seen.has(g.group_id)) throw new Invalid(`${where}.group_id`, `${JSON.stringify(g.group_id)} twice in one request`);
    seen.add(g.group_id);
    if (!served.workflows.includes(g.workflow)) {
      throw new Invalid(`${where}.workflow`, `unknown workflow ${JSON.stringify(g.workflow)}`, 'UNKNOWN_WORKFLOW');
    }
    if (g.policy_ids.length < 1 || g.policy_ids.length > 64) {
      throw new Invalid(`${where}.policy_ids`, `${g.policy_ids.length} policies, expected 1..64`);
    }
    if (new Set(g.policy_ids).size !== g.policy_ids.length) throw new Invalid(`${where}.policy_ids`, 'a policy listed twice');
    g.policy_ids.forEach((p, j) => {
      if (!served.policies.includes(p)) {
        throw new Invalid(`${where}.policy_ids[${j}]`, `unknown policy ${JSON.stringify(p)}`, 'UNKNOWN_POLICY');
      }
    });
    if (g.reward && !served.rewards.includes(g.reward)) {
      throw new Invalid(`${where}.reward`, `unknown reward ${JSON.stringify(g.reward)}`, 'UNKNOWN_REWARD');
    }
    const most = Math.min(MAX_SAMPLES, served.capacity);
    if (g.num_samples < 1 || g.num_samples > most) {
      throw new Invalid(`${where}.num_samples`, `${g.num_samples}, expected 1..${most}`);
    }
    if (!g.sampling_params) throw new Invalid(`${where}.sampling_params`, 'required (max_new_tokens >= 1)');
    checkSampling(g.sampling_params, where);
    if (g.prompt && g.prompt.token_ids) checkPromptTokens(g.prompt.token_ids, `${where}.prompt.token_ids`);
    if (g.prompt && Buffer.byteLength(g.prompt.text || '', 'utf8') > 1 << 20) {
      throw new Invalid(`${where}.prompt.text`, 'more than 1 MiB');
    }
  });
}

// Checks a LoadWeights request (before anything is fetched).
function checkLoad(req, served) {
  if (req.versions.length < 1 || req.versions.length > served.policies.length) {
    throw new Invalid('versions', `${req.versions.length} versions, expected 1..${served.policies.length}`);
  }
  const seen = new Set();
  req.versions.forEach((v, i) => {
    if (!served.policies.includes(v.policy_id)) {
      throw new Invalid(`versions[${i}].policy_id`, `unknown policy ${JSON.stringify(v.policy_id)}`, 'UNKNOWN_POLICY');
    }
    if (seen.has(v.policy_id)) throw new Invalid(`versions[${i}].policy_id`, 'a policy listed twice');
    seen.add(v.policy_id);
    if (v.version < 0) throw new Invalid(`versions[${i}].version`, `${v.version} < 0`);
    checkIdentity(v.version_id, `versions[${i}].version_id`);
  });
  checkString(req.weights_address, 'weights_address', 1, 256);
  checkString(req.request_id, 'request_id', 1, 128);
  for (const [policy, address] of Object.entries(req.policy_weights_addresses || {})) {
    const field = `policy_weights_addresses[${JSON.stringify(policy)}]`;
    if (!served.policies.includes(policy)) throw new Invalid(field, `unknown policy ${JSON.stringify(policy)}`, 'UNKNOWN_POLICY');
    checkString(address, field, 1, 256);
  }
}

module.exports = { Invalid, checkCollect, checkGroups, checkIds, checkLoad, MAX_IDS };
