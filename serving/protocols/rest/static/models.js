// The models page: every model with its version labels, its versions and their states (with the load error of a
// failed one), and the signatures of each AVAILABLE version, as the status and metadata APIs report them.
import { call, el, enc, guarded } from "./common.js";

function shape(info) {
  const dims = info.tensor_shape;
  if (dims.unknown_rank) return "unknown rank";
  return `[${dims.dim.map((d) => (d.size === "-1" ? "?" : d.size)).join(", ")}]`;
}

function tensorRows(kind, tensors) {
  return Object.entries(tensors).map(([name, info]) =>
    el("tr", {}, el("td", {}, kind), el("th", { scope: "row" }, name), el("td", {}, info.dtype), el("td", {}, shape(info))));
}

function signatureTable(key, signature) {
  return el("div", { class: "scroll" },
    el("table", {},
      el("caption", {}, el("code", {}, key), ` ${signature.method_name}`),
      el("thead", {}, el("tr", {}, ...["", "tensor", "dtype", "shape"].map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, ...tensorRows("input", signature.inputs), ...tensorRows("output", signature.outputs))));
}

function versionRow(status) {
  const failed = status.status.error_code !== "OK";
  const detail = failed ? `${status.status.error_code}: ${status.status.error_message}` : "OK";
  return el("tr", failed ? { class: "failed" } : {},
    el("th", { scope: "row" }, status.version), el("td", {}, status.state), el("td", {}, detail));
}

async function signaturesOf(name, version) {
  const { body } = await call(`/v1/models/${enc(name)}/versions/${version}/metadata`);
  const defs = body.metadata.signature_def.signature_def;
  return el("section", { class: "signatures" }, el("h3", {}, `Version ${version}: signatures`),
    ...Object.entries(defs).map(([key, signature]) => signatureTable(key, signature)));
}

async function modelSection({ name, version_labels: labels }) {
  const section = el("section", { class: "model", "aria-labelledby": `model-${name}` },
    el("h2", { id: `model-${name}` }, name));
  const labelText = Object.entries(labels).map(([label, version]) => `${label} → version ${version}`).join(", ");
  section.append(el("p", {}, `Version labels: ${labelText || "none"}`));
  let statuses;
  try {
    statuses = (await call(`/v1/models/${enc(name)}`)).body.model_version_status;
  } catch (error) {
    if (error.status === 401) throw error;
    section.append(el("p", { class: "error" }, error.message));
    return section;
  }
  section.append(el("div", { class: "scroll" }, el("table", {},
    el("caption", {}, "Versions"),
    el("thead", {}, el("tr", {}, ...["version", "state", "status"].map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, ...statuses.map(versionRow)))));
  const available = statuses.filter((s) => s.state === "AVAILABLE").map((s) => s.version);
  section.append(...await Promise.all(available.map((version) => signaturesOf(name, version))));
  return section;
}

async function load() {
  const list = document.getElementById("models");
  try {
    const { body } = await call("/petal/models");
    const sections = await Promise.all(body.models.map(modelSection));
    list.replaceChildren(...(sections.length ? sections : [el("p", {}, "No models are configured.")]));
  } catch (error) {
    list.replaceChildren(); // the error line says why there is nothing to show
    throw error;
  } finally {
    list.removeAttribute("aria-busy");
  }
}

guarded(load);
