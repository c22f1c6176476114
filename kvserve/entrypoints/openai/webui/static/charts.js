// Two small SVG charts drawn by hand: a line over time and a histogram's bars.

const SVG_NS = "http://www.w3.org/2000/svg";

function element(name, attributes, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

// values: numbers, oldest first, drawn across the chart's width (`slots` points wide)
export function lineChart(svg, values, slots) {
  const [width, height] = [400, 100];
  const peak = Math.max(1e-9, ...values);
  const x = (i) => ((i + slots - values.length) / (slots - 1)) * width;
  const y = (v) => height - 4 - (v / peak) * (height - 16);
  const points = values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  svg.replaceChildren(
    element("polyline", { points, class: "line" }),
    element("text", { x: 4, y: 11, class: "axis" }, `peak ${formatNumber(peak)}`));
}

// buckets: [{le, count}] (per bucket); labels name each bucket by its upper bound
export function barChart(svg, buckets, formatBound) {
  const [width, height, bottom] = [400, 110, 14];
  const peak = Math.max(1, ...buckets.map((b) => b.count));
  const slot = width / Math.max(1, buckets.length);
  const labelEvery = Math.ceil(buckets.length / 8);
  const nodes = [];
  buckets.forEach((bucket, i) => {
    const barHeight = (bucket.count / peak) * (height - bottom - 12);
    const bar = element("rect", { x: i * slot + 1, y: height - bottom - barHeight,
                                  width: slot - 2, height: barHeight, class: "bar" });
    bar.append(element("title", {}, `\u2264 ${formatBound(bucket.le)}: ${bucket.count}`));
    nodes.push(bar);
    if (i % labelEvery === 0) {
      nodes.push(element("text", { x: i * slot + slot / 2, y: height - 2, class: "axis",
                                   "text-anchor": "middle" }, formatBound(bucket.le)));
    }
  });
  nodes.push(element("text", { x: 4, y: 11, class: "axis" }, `max ${peak}`));
  svg.replaceChildren(...nodes);
}

export function formatNumber(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "n/a";
  if (Math.abs(value) >= 100 || Number.isInteger(value)) return String(Math.round(value));
  return value.toFixed(1);
}

export function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "n/a";
  if (!Number.isFinite(seconds)) return "\u221e";
  return seconds < 1 ? `${Math.round(seconds * 1000)}ms` : `${seconds}s`;
}
