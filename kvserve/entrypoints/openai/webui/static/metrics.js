// Prometheus text format -> samples, and the few summaries the dashboard shows.

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

// Map of sample name -> [{labels, value}]
export function parseMetrics(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    const match = line.startsWith("#") ? null : SAMPLE.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, name, value] of (match[2] || "").matchAll(LABEL)) {
      labels[name] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    if (!samples.has(match[1])) samples.set(match[1], []);
    samples.get(match[1]).push({ labels, value: Number(match[3]) });
  }
  return samples;
}

// the sum over every label set, or null when the metric is absent
export function total(samples, name) {
  const list = samples.get(name);
  return list ? list.reduce((sum, s) => sum + s.value, 0) : null;
}

// a histogram's buckets [{le, count}] (per bucket, not cumulative), summed over label sets
export function histogram(samples, name) {
  const cumulative = new Map();
  for (const { labels, value } of samples.get(`${name}_bucket`) || []) {
    const le = Number(labels.le);
    cumulative.set(le, (cumulative.get(le) || 0) + value);
  }
  const bounds = [...cumulative.keys()].sort((a, b) => a - b);
  return bounds.map((le, i) => ({
    le, count: cumulative.get(le) - (i ? cumulative.get(bounds[i - 1]) : 0),
  }));
}

// the q-quantile's upper bucket bound (what Prometheus can say without interpolating)
export function quantileBound(buckets, q) {
  const count = buckets.reduce((sum, b) => sum + b.count, 0);
  let seen = 0;
  for (const bucket of buckets) {
    seen += bucket.count;
    if (count && seen >= q * count) return bucket.le;
  }
  return null;
}

// the label value of the sample set to 1, e.g. the regime of kvserve:bottleneck_regime
export function activeLabel(samples, name, label) {
  const active = (samples.get(name) || []).find((s) => s.value === 1);
  return active ? active.labels[label] : null;
}
