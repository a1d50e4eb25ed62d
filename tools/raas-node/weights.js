'use strict';
// A receiver of astra.weights.v1.WeightService/FetchVersion: opens the bidirectional stream
// with a FetchStart naming the version it holds, reads the plan, each tensor's header and
// chunks, decodes it (raw bytes, or one zstd frame of new XOR base: the delta format of
// weight_service.proto), checks the tensor's Adler-32, acknowledges it, and returns the new
// version once FetchDone arrives: the tensors sent, and for a delta every other tensor of the
// base unchanged. Nothing is kept from a stream that did not end with FetchDone, so a caller
// swaps complete, verified versions only. A disconnect fails the fetch (the caller tries
// again from the start) instead of resuming with acknowledged_tensors.

const grpc = require('@grpc/grpc-js');
const fzstd = require('fzstd');

const MOD = 65521;
const NMAX = 5552; // the most bytes before the sums must be reduced (zlib's bound)

function adler32(buf, value = 1) {
  let a = value & 0xffff;
  let b = (value >>> 16) & 0xffff;
  for (let i = 0; i < buf.length; ) {
    const end = Math.min(i + NMAX, buf.length);
    for (; i < end; i++) {
      a += buf[i];
      b += a;
    }
    a %= MOD;
    b %= MOD;
  }
  return ((b << 16) | a) >>> 0;
}

function hex8(value) {
  return value.toString(16).padStart(8, '0');
}

class FetchError extends Error {
  constructor(code, message, reason) {
    super(message);
    this.code = code;
    this.reason = reason;
  }
}

const lost = (message, reason) => new FetchError(grpc.status.DATA_LOSS, message, reason);

// The new bytes of one tensor from its encoded bytes: raw as they came, or xor+zstd decoded
// against the base's bytes of the same name.
function decode(header, encoded, baseTensors) {
  if (header.encoding === 'TENSOR_ENCODING_RAW') return encoded;
  if (header.encoding !== 'TENSOR_ENCODING_XOR_ZSTD') {
    throw lost(`tensor ${header.name}: unknown encoding ${header.encoding}`, 'UNKNOWN_ENCODING');
  }
  const base = baseTensors && baseTensors.get(header.name);
  if (!base || base.length !== header.size_bytes) {
    throw lost(`tensor ${header.name}: a delta without a base tensor of ${header.size_bytes} bytes`, 'WRONG_BASE');
  }
  let out;
  try {
    const u = fzstd.decompress(encoded, new Uint8Array(header.size_bytes));
    out = Buffer.from(u.buffer, u.byteOffset, u.byteLength);
  } catch (err) {
    throw lost(`tensor ${header.name}: the zstd frame does not decode: ${err.message}`, 'BAD_FRAME');
  }
  if (out.length !== header.size_bytes) {
    throw lost(`tensor ${header.name}: decoded ${out.length} bytes, header says ${header.size_bytes}`, 'SIZE_MISMATCH');
  }
  for (let i = 0; i < out.length; i++) out[i] ^= base[i];
  return out;
}

// Fetches `versionId` of `policy` from the WeightService at `address`, naming `held`
// ({ version_id, tensors }, or null) as the version this receiver has; resolves with
// { tensors: Map(name -> Buffer), bytes, base } or rejects with a FetchError (a status code).
function fetchVersion(proto, address, policy, versionId, receiverId, timeoutS, held) {
  const client = new proto.WeightService(address, proto.clientCredentials(), {
    'grpc.max_receive_message_length': 64 << 20,
    'grpc.max_send_message_length': 64 << 20,
  });
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + timeoutS * 1000);
    const call = client.FetchVersion({ deadline });
    let tensors = new Map();
    let base = '';
    let current = null;
    let done = false;
    let failed = null;
    let bytes = 0;

    const fail = (err) => {
      if (!failed) failed = err;
      call.cancel();
    };
    const finish = (t) => {
      const name = t.header.name;
      let data;
      try {
        data = decode(t.header, Buffer.concat(t.parts, t.got), held && held.tensors);
      } catch (err) {
        return fail(err);
      }
      const got = hex8(adler32(data));
      if (data.length !== t.header.size_bytes || got !== t.header.adler32) {
        const why = `adler32 ${got} of ${data.length} bytes, expected ${t.header.adler32} of ${t.header.size_bytes}`;
        call.write({ ack: { name, status: { code: grpc.status.DATA_LOSS, message: why } } });
        return fail(lost(`tensor ${name}: ${why}`, 'CHECKSUM_MISMATCH'));
      }
      tensors.set(name, data);
      current = null;
      call.write({ ack: { name, status: { code: grpc.status.OK } } });
    };

    call.on('data', (msg) => {
      if (failed) return;
      switch (msg.part) {
        case 'plan':
          base = msg.plan.base_version_id;
          if (base) {
            if (!held || base !== held.version_id) {
              return fail(lost(`a delta against ${base}, which this receiver does not hold`, 'WRONG_BASE'));
            }
            tensors = new Map(held.tensors); // the unchanged tensors stay as they are
          }
          break;
        case 'tensor': {
          const h = msg.tensor;
          const size = h.encoding === 'TENSOR_ENCODING_RAW' ? h.size_bytes : h.encoded_size_bytes;
          current = { header: h, size, parts: [], got: 0 };
          if (size === 0) finish(current);
          break;
        }
        case 'chunk':
          if (!current || msg.chunk.offset !== current.got) {
            return fail(lost(`chunk at offset ${msg.chunk.offset} out of order`, 'CHUNK_OUT_OF_ORDER'));
          }
          current.parts.push(msg.chunk.data);
          current.got += msg.chunk.data.length;
          bytes += msg.chunk.data.length;
          if (current.got >= current.size) finish(current); // more than announced: refused there
          break;
        case 'done':
          if (current) return fail(lost(`FetchDone inside tensor ${current.header.name}`, 'TRUNCATED'));
          done = true;
          call.end();
          break;
        default: // VersionFile: config and tokenizer files, not needed without a model
          break;
      }
    });
    call.on('error', (err) => {
      client.close();
      if (failed) return reject(failed);
      reject(new FetchError(err.code, `WeightService ${address}: ${err.details || err.message}`, 'FETCH_FAILED'));
    });
    call.on('end', () => {
      client.close();
      if (failed) return reject(failed);
      if (!done) return reject(new FetchError(grpc.status.UNAVAILABLE, 'the fetch stream ended before FetchDone', 'FETCH_INCOMPLETE'));
      resolve({ tensors, bytes, base });
    });
    call.write({
      start: {
        policy_id: policy,
        target_version_id: versionId,
        held_version_ids: held ? [held.version_id] : [],
        receiver_id: receiverId,
        acknowledged_tensors: [],
        max_bytes_per_second: 0,
      },
    });
  });
}

module.exports = { fetchVersion, adler32, FetchError };
