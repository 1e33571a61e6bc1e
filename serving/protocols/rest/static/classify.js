// The classify page: pick an image model and version, drop or choose a photo, see the top labels as bars with
// their scores, the latency and the equivalent curl command.
import { ApiError, call, el, enc, guarded, token } from "./common.js";

const IMAGE_INPUT = "image_bytes";
const PROBABILITIES_OUTPUT = "probabilities";
const $ = (id) => document.getElementById(id);

let models = []; // [{name, version_labels}] from /petal/models
let photo = null; // the File being classified

// An image model is one whose serving_default takes JPEG bytes and returns probabilities (what :classify_image runs).
function isImageModel(metadata) {
  const signature = metadata.metadata.signature_def.signature_def.serving_default;
  return Boolean(signature?.inputs[IMAGE_INPUT] && signature?.outputs[PROBABILITIES_OUTPUT]);
}

async function imageModelOrNull(model) {
  try {
    const { body } = await call(`/v1/models/${enc(model.name)}/metadata`);
    return isImageModel(body) ? model : null;
  } catch (error) {
    if (error.status === 401) throw error;
    return null; // no version loaded yet, or none that loads: the models page says why
  }
}

async function loadModels() {
  const { body } = await call("/petal/models");
  models = (await Promise.all(body.models.map(imageModelOrNull))).filter(Boolean);
  $("model").replaceChildren(...models.map((model) => new Option(model.name, model.name)));
  if (!models.length) {
    throw new ApiError(0, `No image model is loaded: one needs a serving_default signature with an ` +
      `${IMAGE_INPUT} input and a ${PROBABILITIES_OUTPUT} output (see the models page).`);
  }
  await loadVersions();
}

// "latest", each AVAILABLE version, then each version label; option values are the path segments they add.
async function loadVersions() {
  const model = models.find((m) => m.name === $("model").value);
  const { body } = await call(`/v1/models/${enc(model.name)}`);
  const options = [new Option("latest", "")];
  for (const status of body.model_version_status) {
    if (status.state === "AVAILABLE") options.push(new Option(`version ${status.version}`, `/versions/${status.version}`));
  }
  for (const [label, version] of Object.entries(model.version_labels)) {
    options.push(new Option(`${label} (version ${version})`, `/labels/${enc(label)}`));
  }
  $("version").replaceChildren(...options);
  showCurl();
}

function classifyPath() {
  const topK = Math.max(1, parseInt($("top-k").value, 10) || 5);
  return `/v1/models/${enc($("model").value)}${$("version").value}:classify_image?top_k=${topK}`;
}

// The server takes image/* bodies; anything else goes as octet-stream, so it is the decoder that says what is wrong.
function contentType(file) {
  return file.type.startsWith("image/") ? file.type : "application/octet-stream";
}

function shellQuote(text) {
  return `'${text.replaceAll("'", `'\\''`)}'`;
}

function showCurl() {
  const name = photo ? photo.name : "photo.jpg";
  const lines = [
    `curl -s -X POST --data-binary ${shellQuote("@" + name)}`,
    `-H ${shellQuote("Content-Type: " + (photo ? contentType(photo) : "image/jpeg"))}`,
  ];
  if (token()) lines.push(`-H "Authorization: Bearer $PETAL_TOKEN"`);
  lines.push(shellQuote(location.origin + classifyPath()));
  $("curl").textContent = lines.join(" \\\n  ");
}

function showPredictions(body, ms) {
  const rows = body.predictions.map(({ label, score }) => {
    const percent = `${(score * 100).toFixed(1)}%`;
    const bar = el("span", { class: "bar", "aria-hidden": "true" });
    bar.style.setProperty("--score", `${Math.min(100, score * 100)}%`);
    return el("li", {}, el("span", { class: "label" }, label), el("span", { class: "score" }, percent), bar);
  });
  $("predictions").replaceChildren(...rows);
  $("latency").textContent = `${body.model}, version ${body.version}: answered in ${Math.round(ms)} ms`;
  $("result").hidden = false;
}

async function classify() {
  showCurl();
  if (!photo) return;
  $("result").setAttribute("aria-busy", "true");
  try {
    const { body, ms } = await call(classifyPath(), {
      method: "POST", body: photo, headers: { "Content-Type": contentType(photo) },
    });
    showPredictions(body, ms);
  } catch (error) {
    $("result").hidden = true;
    throw error;
  } finally {
    $("result").removeAttribute("aria-busy");
  }
}

function choose(file) {
  photo = file;
  const preview = $("preview");
  if (preview.src) URL.revokeObjectURL(preview.src);
  preview.src = URL.createObjectURL(file);
  $("photo-name").textContent = file.name;
  guarded(classify);
}

function wire() {
  const drop = $("drop");
  drop.addEventListener("dragover", (event) => {
    event.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    if (event.dataTransfer.files.length) choose(event.dataTransfer.files[0]);
  });
  $("file").addEventListener("change", () => {
    if ($("file").files.length) choose($("file").files[0]);
  });
  $("model").addEventListener("change", () => guarded(async () => {
    await loadVersions();
    await classify();
  }));
  $("version").addEventListener("change", () => guarded(classify));
  $("top-k").addEventListener("change", () => guarded(classify));
  $("classify-form").addEventListener("submit", (event) => {
    event.preventDefault(); // Enter in the top-k field classifies again instead of reloading the page
    guarded(classify);
  });
  $("copy").hidden = !navigator.clipboard; // browsers offer it to https and localhost pages only
  $("copy").addEventListener("click", async () => {
    await navigator.clipboard.writeText($("curl").textContent);
    $("copy").textContent = "Copied";
  });
}

wire();
guarded(loadModels);
