'use strict';
// The RolloutService handlers (rollout_service.proto): groups accepted against free slots,
// run by the deterministic generator, their results held until acknowledged (results.js) and
// sent again on every CollectResults and CollectResultBatch until then; LoadWeights fetches
// and verifies whole versions and swaps every policy of a request together.

const grpc = require('@grpc/grpc-js');
const { groupResult } = require('./generator');
const { Invalid, checkCollect, checkGroups, checkIds, checkLoad } = require('./validate');
const { Results } = require('./results');
const { fetchVersion } = require('./weights');
const { durationS } = require('./protos');
const { CONTRACT_VERSION } = require('./registrar');

const MAX_RESULT_BYTES = 64 << 20;
// A CollectResultBatch response stays this far below the 64 MiB message limit.
const BATCH_BYTES = MAX_RESULT_BYTES - (64 << 10);
const REMEMBERED_LOADS = 256; // request ids of successful loads
const LOAD_TIMEOUT_S = 300;

class Raas {
  constructor(opts, proto, log) {
    Object.assign(this, {
      instanceId: opts.instanceId,
      address: opts.address,
      capacity: opts.capacity,
      policies: opts.policies,
      workflows: opts.workflows,
      rewards: opts.rewards,
      labels: opts.labels,
      delayMs: opts.delayMs,
      tokens: opts.tokens,
      vocab: opts.vocab || 256,
    });
    this.proto = proto;
    this.rpcError = proto.details;
    this.log = log;
    this.freeSlots = opts.capacity;
    this.running = new Map(); // group id -> { timer, samples }
    this.results = new Results();
    // A GroupResult's size on the wire: as a CollectResultsResponse's `result`, framed as a
    // CollectResultBatchResponse's `results` entry is (both field 1).
    const collect = proto.RolloutService.service.CollectResults;
    this.wireBytes = (result) => collect.responseSerialize({ result }).length;
    this.versions = new Map(); // policy -> { version, version_id, tensors }
    this.loads = new Map(); // request id -> { key, response }
    this.loading = Promise.resolve(); // loads run one at a time
    this.counters = { groups_accepted: 0, groups_finished: 0, groups_cancelled: 0, results_acknowledged: 0, versions_loaded: 0 };
  }

  loadedVersions() {
    return [...this.versions].map(([policy_id, v]) => ({ policy_id, version: v.version, version_id: v.version_id }));
  }

  versionOf(policy) {
    const v = this.versions.get(policy);
    return v ? v.version : 0;
  }

  invalid(err) {
    if (err instanceof Invalid) {
      return this.rpcError(grpc.status.INVALID_ARGUMENT, err.message, err.reason, { field: err.field });
    }
    throw err;
  }

  // ----- groups ------------------------------------------------------------------------------

  SubmitGroups(call, callback) {
    const groups = call.request.groups;
    try {
      checkGroups(groups, this);
    } catch (err) {
      return callback(this.invalid(err));
    }
    const fresh = groups.filter((g) => !this.running.has(g.group_id) && !this.results.holds(g.group_id));
    const wanted = fresh.reduce((n, g) => n + g.num_samples, 0);
    if (wanted > this.freeSlots) {
      return callback(
        this.rpcError(grpc.status.RESOURCE_EXHAUSTED, `${wanted} samples asked, ${this.freeSlots} slots free`, 'NO_FREE_SLOTS', {
          retryAfterS: 0.5,
          metadata: { free_slots: String(this.freeSlots), requested: String(wanted) },
        }),
      );
    }
    for (const g of fresh) this.run(g);
    callback(null, { accepted_group_ids: groups.map((g) => g.group_id), free_slots: this.freeSlots });
  }

  run(group) {
    this.freeSlots -= group.num_samples;
    this.counters.groups_accepted += 1;
    const timer = setTimeout(() => {
      this.running.delete(group.group_id);
      this.freeSlots += group.num_samples;
      let { result, bytes } = groupResult(group, this.instanceId, (p) => this.versionOf(p), this.tokens, this.vocab);
      if (bytes > MAX_RESULT_BYTES) {
        // Never deliverable in one message: delivered as the group's failure instead.
        result = {
          group_id: group.group_id,
          trajectories: [],
          instance_id: this.instanceId,
          error: { code: grpc.status.RESOURCE_EXHAUSTED, message: `result of ~${bytes} bytes exceeds the 64 MiB message limit` },
        };
      }
      this.counters.groups_finished += 1;
      this.results.add(group.group_id, result, this.wireBytes(result));
    }, this.delayMs);
    this.running.set(group.group_id, { timer, samples: group.num_samples });
  }

  CollectResults(call) {
    const { max_groups: maxGroups } = call.request;
    const waitS = durationS(call.request.max_wait);
    try {
      checkCollect(maxGroups, waitS);
    } catch (err) {
      return call.emit('error', this.invalid(err));
    }
    this.results.whenReady(call, waitS, () => {
      for (const result of this.results.oldest(maxGroups)) call.write({ result });
      call.end();
    });
  }

  // AckResults and CollectResults in one unary call: the acknowledgements first, then the
  // oldest results in one message, cut short at BATCH_BYTES (one result at least). Every
  // field is checked before anything is dropped.
  CollectResultBatch(call, callback) {
    const { ack_group_ids: acks, max_groups: maxGroups } = call.request;
    const waitS = durationS(call.request.max_wait);
    try {
      checkIds(acks, 'ack_group_ids', 0);
      checkCollect(maxGroups, waitS);
    } catch (err) {
      return callback(this.invalid(err));
    }
    this.acknowledge(acks);
    this.results.whenReady(call, waitS, () => callback(null, { results: this.results.oldest(maxGroups, BATCH_BYTES) }));
  }

  AckResults(call, callback) {
    const ids = call.request.group_ids;
    try {
      checkIds(ids, 'group_ids');
    } catch (err) {
      return callback(this.invalid(err));
    }
    const acknowledged = this.acknowledge(ids);
    callback(null, { acknowledged, ignored: ids.length - acknowledged });
  }

  acknowledge(ids) {
    const acknowledged = this.results.acknowledge(ids);
    this.counters.results_acknowledged += acknowledged;
    return acknowledged;
  }

  CancelGroups(call, callback) {
    const ids = call.request.group_ids;
    try {
      checkIds(ids, 'group_ids');
    } catch (err) {
      return callback(this.invalid(err));
    }
    let cancelled = 0;
    for (const id of ids) {
      const r = this.running.get(id);
      if (!r) continue;
      clearTimeout(r.timer);
      this.running.delete(id);
      this.freeSlots += r.samples;
      cancelled += 1;
    }
    this.counters.groups_cancelled += cancelled;
    callback(null, { cancelled });
  }

  // ----- weights -----------------------------------------------------------------------------

  LoadWeights(call, callback) {
    const req = call.request;
    try {
      checkLoad(req, this);
    } catch (err) {
      return callback(this.invalid(err));
    }
    const key = JSON.stringify(req.versions.map((v) => [v.policy_id, v.version, v.version_id]).sort());
    const run = () => this.load(req, key);
    this.loading = this.loading.then(run, run);
    this.loading.then(
      (response) => callback(null, response),
      (err) => callback(err),
    );
  }

  async load(req, key) {
    const earlier = this.loads.get(req.request_id);
    if (earlier) {
      if (earlier.key !== key) {
        throw this.rpcError(grpc.status.INVALID_ARGUMENT, `request_id ${req.request_id} was used for other versions`, 'REQUEST_ID_REUSED', { field: 'request_id' });
      }
      return earlier.response;
    }
    for (const v of req.versions) {
      const held = this.versions.get(v.policy_id);
      if (held && v.version < held.version) {
        throw this.rpcError(grpc.status.FAILED_PRECONDITION, `${v.policy_id}: version ${v.version} is older than ${held.version}, held`, 'VERSION_REGRESSION', {
          metadata: { policy_id: v.policy_id, held: String(held.version), requested: String(v.version) },
        });
      }
    }
    const todo = req.versions.filter((v) => {
      const held = this.versions.get(v.policy_id);
      return !held || held.version !== v.version || held.version_id !== v.version_id;
    });
    let fetched = 0;
    const staged = await Promise.all(
      todo.map(async (v) => {
        const address = (req.policy_weights_addresses || {})[v.policy_id] || req.weights_address;
        try {
          const held = this.versions.get(v.policy_id) || null; // a delta against it if it can
          const resumed = (err, attempt, verified) =>
            this.log(`${v.policy_id}@${v.version_id}: fetch attempt ${attempt} failed (${err.message}); resuming after ${verified} verified tensors`);
          const got = await fetchVersion(this.proto, address, v.policy_id, v.version_id, this.instanceId, LOAD_TIMEOUT_S, held, resumed);
          fetched += got.bytes;
          return [v, got.tensors, got.base];
        } catch (err) {
          const code = err.code || grpc.status.UNAVAILABLE;
          throw this.rpcError(code, `${v.policy_id} ${v.version_id}: ${err.message}`, err.reason || 'FETCH_FAILED', { metadata: { policy_id: v.policy_id } });
        }
      }),
    );
    // Every version verified: swap them all at once (no result mixes old and new).
    for (const [v, tensors] of staged) this.versions.set(v.policy_id, { version: v.version, version_id: v.version_id, tensors });
    this.counters.versions_loaded += staged.length;
    const response = { loaded_versions: this.loadedVersions(), fetched_bytes: fetched };
    this.loads.set(req.request_id, { key, response });
    while (this.loads.size > REMEMBERED_LOADS) this.loads.delete(this.loads.keys().next().value);
    if (staged.length) {
      const what = staged.map(([v, , b]) => `${v.policy_id}@${v.version_id} (${b ? `delta against ${b}` : 'full copy'})`);
      this.log(`loaded ${what.join(', ')}, ${fetched} bytes`);
    }
    return response;
  }

  // ----- status ------------------------------------------------------------------------------

  GetStatus(_call, callback) {
    callback(null, {
      instance_id: this.instanceId,
      capacity: this.capacity,
      free_slots: this.freeSlots,
      running_groups: this.running.size,
      pending_results: this.results.size,
      loaded_versions: this.loadedVersions(),
      policy_ids: this.policies,
      workflows: this.workflows,
      engine: 'scripted-node',
      counters: this.counters,
    });
  }

  GetCapabilities(_call, callback) {
    callback(null, {
      capabilities: {
        contract_version: CONTRACT_VERSION,
        features: ['multi_policy', 'cancel'],
        implementation: 'astra-raas-node',
        implementation_version: require('./package.json').version,
      },
    });
  }

  handlers() {
    const names = ['SubmitGroups', 'CollectResults', 'AckResults', 'CollectResultBatch', 'CancelGroups', 'LoadWeights', 'GetStatus', 'GetCapabilities'];
    return Object.fromEntries(names.map((n) => [n, this[n].bind(this)]));
  }
}

module.exports = { Raas };
