// Opus-in-Ogg streaming for the browser on WebCodecs, no dependencies. 24 kHz mono both ways.
//
// OpusSender:   Float32 PCM -> AudioEncoder (opus, 20 ms frames) -> Ogg pages (RFC 3533 framing,
//               RFC 7845 Opus mapping: an OpusHead BOS page, an OpusTags page, then one audio page
//               per 4 packets, ~80 ms, with granule positions in 48 kHz samples).
// OpusReceiver: Ogg bytes (pages may be split across push() calls) -> Opus packets (RFC 6716) ->
//               AudioDecoder -> Float32 PCM. Like sphn's reader it streams the audio as decoded,
//               without trimming the pre-skip (a few ms of codec delay). Chromium's decoder gives
//               48 kHz whatever it is asked, so its output is low-passed and decimated to 24 kHz.
// Errors go to the optional onError(message) callback (default: console.error), never thrown.

const RATE = 24000;
const PACKETS_PER_PAGE = 4;
const ascii = (s) => Uint8Array.from(s, (c) => c.charCodeAt(0));
const text = (bytes) => String.fromCharCode(...bytes);
const message = (e) => String(e?.message ?? e);

// Ogg CRC32: polynomial 0x04C11DB7, initial value 0, no reflection, no final xor.
const CRC_TABLE = new Uint32Array(256).map((_, i) => {
  let r = i << 24;
  for (let k = 0; k < 8; k++) r = r & 0x80000000 ? (r << 1) ^ 0x04c11db7 : r << 1;
  return r >>> 0;
});
function oggCrc(bytes) {
  let crc = 0;
  for (const b of bytes) crc = ((crc << 8) ^ CRC_TABLE[((crc >>> 24) ^ b) & 0xff]) >>> 0;
  return crc;
}

// Samples at 48 kHz in one Opus packet, from its TOC byte (RFC 6716 section 3.1).
function packetSamples48k(packet) {
  const config = packet[0] >> 3, code = packet[0] & 3;
  const frame = config < 12 ? [480, 960, 1920, 2880][config & 3]
    : config < 16 ? [480, 960][config & 1] : [120, 240, 480, 960][config & 3];
  return frame * (code === 0 ? 1 : code < 3 ? 2 : (packet[1] ?? 0) & 0x3f);
}

function findCapture(bytes, from) {
  for (let i = from; i + 4 <= bytes.length; i++) {
    if (bytes[i] === 0x4f && bytes[i + 1] === 0x67 && bytes[i + 2] === 0x67 && bytes[i + 3] === 0x53) return i;
  }
  return -1;
}

// One Ogg page (RFC 3533 section 6) holding whole packets (fewer than 255 lacing values in all).
function oggPage(packets, { serial, seq, granule, flags }) {
  const lacing = packets.flatMap((p) => [...Array(Math.floor(p.length / 255)).fill(255), p.length % 255]);
  const page = new Uint8Array(27 + lacing.length + packets.reduce((n, p) => n + p.length, 0));
  const view = new DataView(page.buffer);
  page.set(ascii("OggS")); // byte 4, the stream structure version, stays 0
  page[5] = flags; // 0x02 beginning of stream, 0x04 end of stream
  view.setUint32(6, granule % 2 ** 32, true);
  view.setUint32(10, Math.floor(granule / 2 ** 32), true);
  view.setUint32(14, serial, true);
  view.setUint32(18, seq, true);
  page[26] = lacing.length;
  page.set(lacing, 27);
  let at = 27 + lacing.length;
  for (const p of packets) { page.set(p, at); at += p.length; }
  view.setUint32(22, oggCrc(page), true); // computed while the CRC field is still zero
  return page;
}

export class OpusSender {
  constructor(onPage, { bitrate = 24000, onError = null } = {}) {
    this.onPage = onPage;
    this.onError = onError ?? ((m) => console.error("OpusSender:", m));
    this.serial = crypto.getRandomValues(new Uint32Array(1))[0];
    this.seq = 0;
    this.granule = 0; // 48 kHz samples in all packets encoded so far, pre-skip included
    this.pageGranule = 0; // granule position of the last page sent
    this.preSkip = null; // set, and the header pages sent, with the first encoded packet
    this.samplesIn = 0;
    this.packets = []; // encoded packets not yet sent
    this.encoder = new AudioEncoder({
      output: (chunk, meta) => { try { this._packet(chunk, meta); } catch (e) { this.onError(message(e)); } },
      error: (e) => this.onError(message(e)),
    });
    this.encoder.configure({ codec: "opus", sampleRate: RATE, numberOfChannels: 1, bitrate, opus: { frameDuration: 20000 } });
  }

  push(samples) {
    try {
      if (this.encoder.state !== "configured" || samples.length === 0) return;
      const timestamp = Math.round((this.samplesIn * 1e6) / RATE);
      const data = new AudioData({ format: "f32-planar", sampleRate: RATE, numberOfChannels: 1,
        numberOfFrames: samples.length, timestamp, data: Float32Array.from(samples) });
      this.samplesIn += samples.length;
      this.encoder.encode(data);
      data.close();
    } catch (e) {
      this.onError(message(e));
    }
  }

  async close() {
    try {
      if (this.encoder.state !== "configured") return;
      await this.encoder.flush();
      if (this.preSkip === null) return; // nothing was encoded
      const end = this.preSkip + this.samplesIn * 2; // where the real input ends, in 48 kHz samples
      if (this.packets.length === 0) { // the end-of-stream page needs a packet: add 20 ms of silence
        this.push(new Float32Array(RATE / 50));
        await this.encoder.flush();
      }
      // End trimming (RFC 7845 section 4.4), never below the previous page's granule position.
      this._emit(this.packets, 0x04, Math.max(this.pageGranule, Math.min(this.granule, end)));
    } catch (e) {
      this.onError(message(e));
    } finally {
      if (this.encoder.state !== "closed") this.encoder.close();
    }
  }

  _packet(chunk, meta) {
    if (this.preSkip === null) this._headers(meta?.decoderConfig?.description);
    const packet = new Uint8Array(chunk.byteLength);
    chunk.copyTo(packet);
    this.packets.push(packet);
    this.granule += packetSamples48k(packet);
    if (this.packets.length >= PACKETS_PER_PAGE) this._emit(this.packets, 0);
  }

  _headers(description) {
    // The pre-skip comes from the encoder's own OpusHead if it gives one, else Opus's usual 312.
    // Chromium counts it at its input rate (156 at 24 kHz); RFC 7845 counts 48 kHz samples.
    const d = description && new Uint8Array(description.buffer ?? description, description.byteOffset ?? 0);
    const dv = d?.length >= 19 && text(d.subarray(0, 8)) === "OpusHead" && new DataView(d.buffer, d.byteOffset);
    this.preSkip = dv ? Math.round((dv.getUint16(10, true) * 48000) / (dv.getUint32(12, true) || 48000)) : 312;
    const head = new Uint8Array(19); // RFC 7845 section 5.1
    const view = new DataView(head.buffer);
    head.set(ascii("OpusHead"));
    head[8] = 1; // version
    head[9] = 1; // channel count
    view.setUint16(10, this.preSkip, true);
    view.setUint32(12, RATE, true); // input sample rate; output gain (int16) and mapping family stay 0
    const vendor = ascii("opus.js WebCodecs");
    const tags = new Uint8Array(8 + 4 + vendor.length + 4); // RFC 7845 section 5.2, no user comments
    tags.set(ascii("OpusTags"));
    new DataView(tags.buffer).setUint32(8, vendor.length, true);
    tags.set(vendor, 12);
    this._emit([head], 0x02, 0);
    this._emit([tags], 0, 0);
  }

  _emit(packets, flags, granule = this.granule) {
    this.packets = [];
    this.pageGranule = granule;
    this.onPage(oggPage(packets, { serial: this.serial, seq: this.seq++, granule, flags }));
  }
}

export class OpusReceiver {
  constructor(onAudio, { onError = null } = {}) {
    this.onAudio = onAudio;
    this.onError = onError ?? ((m) => console.error("OpusReceiver:", m));
    this.buffer = new Uint8Array(0); // bytes of an incomplete page
    this.partial = []; // segments of a packet not finished yet (it may go on in the next page)
    this.timestamp = 0; // microseconds
    this.decoder = new AudioDecoder({
      output: (data) => {
        try {
          const out = new Float32Array(data.numberOfFrames);
          data.copyTo(out, { planeIndex: 0, format: "f32-planar" });
          this.onAudio(this._resample(out, data.sampleRate));
        } catch (e) {
          this.onError(message(e));
        } finally {
          data.close();
        }
      },
      error: (e) => this.onError(message(e)),
    });
    this.decoder.configure({ codec: "opus", sampleRate: RATE, numberOfChannels: 1 });
  }

  push(bytes) {
    try {
      const all = new Uint8Array(this.buffer.length + bytes.byteLength);
      all.set(this.buffer);
      all.set(new Uint8Array(bytes.buffer ?? bytes, bytes.byteOffset ?? 0, bytes.byteLength), this.buffer.length);
      let at = 0;
      while (all.length - at >= 27) {
        const start = findCapture(all, at);
        if (start !== at) { // lost sync: skip to the next "OggS" capture pattern
          this.onError("bad Ogg capture pattern, resyncing");
          this.partial = [];
          at = start < 0 ? Math.max(at + 1, all.length - 3) : start;
          continue;
        }
        const lacing = all.subarray(at + 27, at + 27 + all[at + 26]);
        const size = 27 + all[at + 26] + lacing.reduce((n, v) => n + v, 0);
        if (lacing.length < all[at + 26] || all.length - at < size) break; // wait for the rest
        this._page(all.slice(at, at + size), lacing.length);
        at += size;
      }
      this.buffer = all.slice(at);
    } catch (e) {
      this.onError(message(e));
    }
  }

  _page(page, nsegs) {
    const crc = new DataView(page.buffer).getUint32(22, true);
    page.fill(0, 22, 26);
    if (oggCrc(page) !== crc) { this.onError("Ogg page CRC mismatch, page dropped"); this.partial = []; return; }
    if (!(page[5] & 0x01)) this.partial = []; // not a continued page: drop any unfinished packet
    let at = 27 + nsegs;
    for (const v of page.subarray(27, 27 + nsegs)) {
      this.partial.push(page.subarray(at, (at += v)));
      if (v === 255) continue; // a 255 lacing value: the packet goes on, maybe on the next page
      const packet = new Uint8Array(this.partial.reduce((n, s) => n + s.length, 0));
      this.partial.reduce((p, s) => (packet.set(s, p), p + s.length), 0);
      this.partial = [];
      this._packet(packet);
    }
  }

  _packet(packet) {
    const magic = text(packet.subarray(0, 8));
    if (packet.length === 0 || magic === "OpusHead" || magic === "OpusTags") return;
    if (this.decoder.state !== "configured") return;
    const duration = Math.round((packetSamples48k(packet) * 1e6) / 48000);
    this.decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: this.timestamp, duration, data: packet }));
    this.timestamp += duration;
  }

  // Streaming decimation by an integer factor through a windowed-sinc (Hamming) low-pass filter.
  _resample(x, rate) {
    if (rate === RATE) return x;
    const f = rate / RATE;
    if (!Number.isInteger(f)) throw new Error(`decoder gave ${rate} Hz, not a multiple of ${RATE}`);
    if (this.factor !== f) {
      const n = 16 * f + 1, m = 8 * f, fc = 0.45 / f;
      const h = Array.from({ length: n }, (_, i) => (i === m ? 2 * fc : Math.sin(2 * Math.PI * fc * (i - m)) / (Math.PI * (i - m)))
        * (0.54 - 0.46 * Math.cos((Math.PI * i) / m)));
      const sum = h.reduce((a, b) => a + b, 0);
      Object.assign(this, { factor: f, fir: h.map((v) => v / sum), tail: new Float32Array(n - 1), phase: 0 });
    }
    const h = this.fir, buf = new Float32Array(this.tail.length + x.length);
    buf.set(this.tail);
    buf.set(x, this.tail.length);
    const out = new Float32Array(Math.max(0, Math.ceil((x.length - this.phase) / f)));
    for (let j = 0, i = this.phase; j < out.length; i += f, j++) {
      for (let k = 0; k < h.length; k++) out[j] += h[k] * buf[i + k]; // the window ending at x[i]
    }
    this.phase += out.length * f - x.length;
    this.tail = buf.slice(x.length);
    return out;
  }

  async close() {
    try {
      if (this.decoder.state === "configured") await this.decoder.flush();
    } catch (e) {
      this.onError(message(e));
    } finally {
      if (this.decoder.state !== "closed") this.decoder.close();
    }
  }
}
