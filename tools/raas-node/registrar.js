'use strict';
// Registration with Dataflow (astra.dataflow.v1.DataflowService): RegisterInstance with
// backoff until it answers, HeartbeatInstance every interval it returns, RegisterInstance
// again when a heartbeat says NOT_FOUND (Dataflow restarted and forgot this instance; the
// results it holds stay until acknowledged), DeregisterInstance on a clean stop.

const crypto = require('crypto');
const grpc = require('@grpc/grpc-js');
const { durationS } = require('./protos');

const CALL_TIMEOUT_S = 5;
const CONTRACT_VERSION = '1.0.0';

class Registrar {
  // `raas` is the Raas (raas.js): its instance id, address, capacity, policies, workflows,
  // labels, free slots, pending results and loaded versions.
  constructor(proto, dataflowAddress, raas, log) {
    this.client = new proto.DataflowService(dataflowAddress, proto.clientCredentials());
    this.address = dataflowAddress;
    this.raas = raas;
    this.log = log;
    this.incarnation = crypto.randomBytes(8).toString('hex'); // new at every process start
    this.intervalS = 1;
    this.stopped = false;
    this.timer = null;
  }

  call(method, request) {
    const deadline = new Date(Date.now() + CALL_TIMEOUT_S * 1000);
    return new Promise((resolve, reject) =>
      this.client[method](request, { deadline }, (err, resp) => (err ? reject(err) : resolve(resp))),
    );
  }

  async register() {
    const r = this.raas;
    let backoffS = 0.1;
    while (!this.stopped) {
      try {
        const resp = await this.call('RegisterInstance', {
          instance_id: r.instanceId,
          address: r.address,
          capacity: r.capacity,
          policy_ids: r.policies,
          workflows: r.workflows,
          labels: r.labels,
          loaded_versions: r.loadedVersions(),
          contract_version: CONTRACT_VERSION,
          incarnation: this.incarnation,
        });
        this.intervalS = durationS(resp.heartbeat_interval) || 1;
        this.log(`registered with Dataflow ${this.address} (${resp.dataflow_id}), heartbeat every ${this.intervalS} s`);
        return;
      } catch (err) {
        if (err.code === grpc.status.INVALID_ARGUMENT || err.code === grpc.status.FAILED_PRECONDITION) {
          throw new Error(`Dataflow ${this.address} refused the registration: ${err.details}`);
        }
        this.log(`registration with ${this.address} failed (${err.details || err.message}); again in ${backoffS} s`);
        await sleep(backoffS);
        backoffS = Math.min(backoffS * 2, 5);
      }
    }
  }

  async start() {
    await this.register();
    this.schedule();
  }

  schedule() {
    if (this.stopped) return;
    this.timer = setTimeout(() => this.beat().finally(() => this.schedule()), this.intervalS * 1000);
  }

  async beat() {
    const r = this.raas;
    try {
      const resp = await this.call('HeartbeatInstance', {
        instance_id: r.instanceId,
        free_slots: r.freeSlots,
        loaded_versions: r.loadedVersions(),
        pending_results: r.results.size,
      });
      this.intervalS = durationS(resp.heartbeat_interval) || this.intervalS;
    } catch (err) {
      if (err.code === grpc.status.NOT_FOUND) {
        this.log('Dataflow no longer knows this instance: registering again');
        try {
          await this.register();
        } catch (refused) {
          this.log(refused.message); // a refusal that retrying cannot change
          process.exit(1);
        }
      } else {
        this.log(`heartbeat failed: ${err.details || err.message}`); // the next one follows
      }
    }
  }

  async stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    try {
      await this.call('DeregisterInstance', { instance_id: this.raas.instanceId });
    } catch (err) {
      this.log(`deregistration failed: ${err.details || err.message}`);
    }
    this.client.close();
  }
}

function sleep(s) {
  return new Promise((resolve) => setTimeout(resolve, s * 1000));
}

module.exports = { Registrar, CONTRACT_VERSION, sleep };
