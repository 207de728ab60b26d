/* qhoptim hyperparameter advisor.
 *
 * The formulas mirror qhoptim.convert (from_sgd, from_momentum, from_nesterov,
 * from_adam), its error messages, and qhoptim.analysis.qhadam_update_bound;
 * docs/_ext/advisor_cases.py writes the same logic with the Python functions
 * and tests/docs/test_site.py checks, in Chromium, that this page answers
 * every generated case exactly as Python does.
 */
(function () {
  "use strict";

  var SUGGESTED_QHM = { nu: 0.7, momentum: 0.999 };
  var SUGGESTED_QHADAM = { nu1: 0.7, beta1: 0.999, nu2: 1.0 };

  // ------------------------------------------------------------ numbers
  // Python's repr() of a float, so messages read exactly as qhoptim's.
  function pyrepr(x) {
    if (Number.isNaN(x)) return "nan";
    if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
    if (x === 0) return Object.is(x, -0) ? "-0.0" : "0.0";
    var parts = x.toExponential().split("e");
    var exp = parseInt(parts[1], 10);
    if (exp < -4 || exp >= 16) {
      return parts[0] + "e" + (exp < 0 ? "-" : "+") + String(Math.abs(exp)).padStart(2, "0");
    }
    var s = String(x);
    return s.indexOf(".") >= 0 ? s : s + ".0";
  }

  // What the site shows: 12 significant digits, written as Python would.
  function show(x) {
    return pyrepr(Number(x.toPrecision(12)));
  }

  function ValidationError(message) {
    this.name = "ValueError";
    this.message = message;
    this.argument = message.split(" must ")[0];
  }

  // float(text) as Python parses it (decimal and exponent forms, inf, nan).
  function parseFloatPy(text, name) {
    var s = String(text).trim().replace(/_/g, "");
    if (/^[+-]?(inf|infinity)$/i.test(s)) return s[0] === "-" ? -Infinity : Infinity;
    if (/^[+-]?nan$/i.test(s)) return NaN;
    if (/^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i.test(s)) return Number(s);
    throw new ValidationError(name + " must be a real number; received " + name + "='" + text + "'");
  }

  // ------------------------------------------------- qhoptim.validation
  function interval(x, name, low, high, lowClosed, highClosed) {
    var ok = !Number.isNaN(x) && (lowClosed ? x >= low : x > low) && (highClosed ? x <= high : x < high);
    if (!ok) {
      var fmt = function (v) { return Number.isFinite(v) ? String(v) : (v > 0 ? "inf" : "-inf"); };
      var text = (lowClosed ? "[" : "(") + fmt(low) + ", " + fmt(high) + (highClosed ? "]" : ")");
      throw new ValidationError(name + " must be in " + text + "; received " + name + "=" + pyrepr(x));
    }
    return x;
  }

  // As qhoptim.convert: the range check alone decides NaN and infinities.
  function checkLr(x, name) { return interval(x, name, 0, Infinity, true, false); }
  function checkBeta(x, name) { return interval(x, name, 0, 1, true, false); }
  function checkEps(x, name) { return interval(x, name, 0, Infinity, true, false); }

  // ---------------------------------------------------- qhoptim.convert
  function fromSgd(lr) {
    return { lr: checkLr(lr, "lr"), nu: 0.0, momentum: 0.0 };
  }

  function heavyBall(lr, momentum, nesterov) {
    lr = checkLr(lr, "lr");
    momentum = checkBeta(momentum, "momentum");
    return { lr: lr / (1 - momentum), nu: nesterov ? momentum : 1.0, momentum: momentum };
  }

  function fromAdam(lr, beta1, beta2, eps) {
    lr = checkLr(lr, "lr");
    beta1 = checkBeta(beta1, "betas[0]");
    beta2 = checkBeta(beta2, "betas[1]");
    eps = checkEps(eps, "eps");
    return { lr: lr, beta1: beta1, beta2: beta2, nu1: 1.0, nu2: 1.0, eps: eps };
  }

  // qhoptim.analysis.qhadam_update_bound(nu1, beta1, nu2, beta2), t -> infinity;
  // null where it raises (outside 0 < beta1 < sqrt(beta2) < 1) or is infinite.
  function qhadamBound(nu1, beta1, nu2, beta2) {
    if (!(beta2 > 0 && beta2 < 1)) return null;
    var gap = beta2 - beta1 * beta1;
    if (!(beta1 > 0 && beta1 < Math.sqrt(beta2) && gap > 0)) return null;
    if (!(nu2 >= 0 && nu2 <= 1)) return null;
    var immediate = Math.pow(1.0 - nu1 * beta1, 2) / (1.0 - nu2 * beta2);
    if (nu1 === 0) return Math.sqrt(immediate);
    if (nu2 === 0) return null;
    var weight = nu1 * beta1 * (1.0 - beta1);
    return Math.sqrt(immediate + (weight * weight * 1.0) / (nu2 * (1.0 - beta2) * gap));
  }

  // The advisor, as docs/_ext/advisor_cases.advise: input fields are strings.
  function advise(input) {
    try {
      if (input.optimizer === "sgd") {
        var lr = parseFloatPy(input.lr, "lr");
        var momentum = parseFloatPy(input.momentum, "momentum");
        var fn, p;
        if (input.nesterov) {
          fn = "from_nesterov";
          p = heavyBall(lr, momentum, true);
        } else if (momentum === 0) {
          fn = "from_sgd";
          p = fromSgd(lr);
        } else {
          fn = "from_momentum";
          p = heavyBall(lr, momentum, false);
        }
        return {
          function: fn,
          exactness: "exact",
          equivalent: { optimizer: "qhm", lr: p.lr, momentum: p.momentum, nu: p.nu },
          suggested: { optimizer: "qhm", lr: p.lr, nu: SUGGESTED_QHM.nu, momentum: SUGGESTED_QHM.momentum },
        };
      }
      var q = fromAdam(
        parseFloatPy(input.lr, "lr"),
        parseFloatPy(input.beta1, "betas[0]"),
        parseFloatPy(input.beta2, "betas[1]"),
        parseFloatPy(input.eps, "eps")
      );
      var s = SUGGESTED_QHADAM;
      return {
        function: "from_adam",
        exactness: "exact",
        equivalent: {
          optimizer: "qhadam", lr: q.lr, beta1: q.beta1, beta2: q.beta2, nu1: q.nu1, nu2: q.nu2,
          eps: q.eps, bound: qhadamBound(q.nu1, q.beta1, q.nu2, q.beta2),
        },
        suggested: {
          optimizer: "qhadam", lr: q.lr, beta1: s.beta1, beta2: q.beta2, nu1: s.nu1, nu2: s.nu2,
          eps: q.eps, bound: qhadamBound(s.nu1, s.beta1, s.nu2, q.beta2),
        },
      };
    } catch (e) {
      if (e instanceof ValidationError) return { error: { name: e.argument, message: e.message } };
      throw e;
    }
  }

  // ------------------------------------------------------------ output
  var LABELS = {
    lr: ["lr", "α, the learning rate"],
    momentum: ["momentum", "β, the buffer's discount"],
    nu: ["nu", "ν, the immediate discount"],
    beta1: ["betas[0]", "β₁"],
    beta2: ["betas[1]", "β₂"],
    nu1: ["nus[0]", "ν₁"],
    nu2: ["nus[1]", "ν₂"],
    eps: ["eps", "ε, after bias correction"],
  };
  var ORDER = { qhm: ["lr", "momentum", "nu"], qhadam: ["lr", "beta1", "beta2", "nu1", "nu2", "eps"] };

  function code(framework, cfg) {
    var v = function (key) { return show(cfg[key]); };
    var args = function (pairs) {
      return pairs.map(function (p) { return "    " + p[0] + "=" + p[1] + ",\n"; }).join("");
    };
    if (cfg.optimizer === "qhm") {
      var qhm = [["momentum", v("momentum")], ["nu", v("nu")]];
      if (framework === "torch") {
        return "from qhoptim.torch import QHM\n\noptimizer = QHM(\n    model.parameters(),\n" +
          args([["lr", v("lr")]].concat(qhm)) + ")";
      }
      if (framework === "keras") {
        return "from qhoptim.keras import QHM\n\noptimizer = QHM(\n" +
          args([["learning_rate", v("lr")]].concat(qhm)) + ")";
      }
      return "import qhoptim.optax as qho\n\ntx = qho.qhm(\n" + args([["learning_rate", v("lr")]].concat(qhm)) + ")";
    }
    if (framework === "torch") {
      return "from qhoptim.torch import QHAdam\n\noptimizer = QHAdam(\n    model.parameters(),\n" + args([
        ["lr", v("lr")], ["betas", "(" + v("beta1") + ", " + v("beta2") + ")"],
        ["nus", "(" + v("nu1") + ", " + v("nu2") + ")"], ["eps", v("eps")],
      ]) + ")";
    }
    if (framework === "keras") {
      return "from qhoptim.keras import QHAdam\n\noptimizer = QHAdam(\n" + args([
        ["learning_rate", v("lr")], ["beta_1", v("beta1")], ["beta_2", v("beta2")],
        ["nu_1", v("nu1")], ["nu_2", v("nu2")], ["epsilon", v("eps")],
      ]) + ")";
    }
    return "import qhoptim.optax as qho\n\ntx = qho.qhadam(\n" + args([
      ["learning_rate", v("lr")], ["b1", v("beta1")], ["b2", v("beta2")],
      ["nu1", v("nu1")], ["nu2", v("nu2")], ["eps", v("eps")],
    ]) + ")";
  }

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fillTable(table, cfg) {
    table.textContent = "";
    ORDER[cfg.optimizer].forEach(function (key) {
      var row = el("tr");
      var name = el("th", { scope: "row" });
      name.appendChild(el("code", {}, LABELS[key][0]));
      name.appendChild(el("span", { class: "qh-hint" }, " " + LABELS[key][1]));
      row.appendChild(name);
      row.appendChild(el("td", { "data-key": key, "data-value": String(cfg[key]) }, show(cfg[key])));
      table.appendChild(row);
    });
    if (cfg.optimizer === "qhadam") {
      var row = el("tr");
      var th = el("th", { scope: "row" }, "per-step bound on |Δθ| / α");
      row.appendChild(th);
      var text = cfg.bound === null ? "none (needs 0 < β₁ < √β₂)" : cfg.bound.toFixed(4);
      row.appendChild(el("td", { "data-key": "bound", "data-value": cfg.bound === null ? "null" : String(cfg.bound) }, text));
      table.appendChild(row);
    }
  }

  function formInput(form) {
    var optimizer = form.querySelector("input[name=qh-optimizer]:checked").value;
    var get = function (id) { return form.querySelector("#" + id).value; };
    if (optimizer === "sgd") {
      return {
        optimizer: "sgd", lr: get("qh-sgd-lr"), momentum: get("qh-sgd-momentum"),
        nesterov: form.querySelector("#qh-sgd-nesterov").checked,
      };
    }
    return {
      optimizer: "adam", lr: get("qh-adam-lr"), beta1: get("qh-adam-beta1"),
      beta2: get("qh-adam-beta2"), eps: get("qh-adam-eps"),
    };
  }

  function render() {
    var root = document.getElementById("qh-advisor");
    if (!root) return;
    var form = root.querySelector("form");
    var framework = form.querySelector("input[name=qh-framework]:checked").value;
    var input = formInput(form);
    root.querySelectorAll(".qh-fields").forEach(function (box) {
      box.hidden = box.getAttribute("data-for") !== input.optimizer;
    });
    var answer = advise(input);
    var error = root.querySelector("#qh-error");
    var results = root.querySelector("#qh-results");
    root.setAttribute("data-state", answer.error ? "error" : "ok");
    if (answer.error) {
      error.hidden = false;
      error.textContent = "ValueError: " + answer.error.message;
      error.setAttribute("data-argument", answer.error.name);
      results.hidden = true;
      return;
    }
    error.hidden = true;
    error.textContent = "";
    results.hidden = false;
    fillTable(root.querySelector("#qh-equivalent"), answer.equivalent);
    fillTable(root.querySelector("#qh-suggested"), answer.suggested);
    root.querySelector("#qh-equivalent-code").textContent = code(framework, answer.equivalent);
    root.querySelector("#qh-suggested-code").textContent = code(framework, answer.suggested);
    root.querySelector("#qh-function").textContent = call(input, answer.function);
    root.querySelector("#qh-equivalent-note").textContent = equivalentNote(framework, input);
    root.querySelector("#qh-suggested-note").textContent = suggestedNote(input, answer);
  }

  function call(input, fn) {
    var n = function (text, name) { return show(parseFloatPy(text, name)); };
    if (fn === "from_sgd") return "qhoptim.convert.from_sgd(lr=" + n(input.lr, "lr") + ")";
    if (fn === "from_adam") {
      return "qhoptim.convert.from_adam(lr=" + n(input.lr, "lr") + ", betas=(" + n(input.beta1, "b") + ", " +
        n(input.beta2, "b") + "), eps=" + n(input.eps, "eps") + ")";
    }
    return "qhoptim.convert." + fn + "(lr=" + n(input.lr, "lr") + ", momentum=" + n(input.momentum, "m") + ")";
  }

  function equivalentNote(framework, input) {
    if (input.optimizer === "sgd") {
      var base = "Same trajectory as torch.optim.SGD, optax.sgd and keras.optimizers.SGD with these settings: " +
        "QHM's buffer is an average, so its learning rate is lr / (1 − momentum).";
      if (framework === "keras") {
        base += " Keras folds the learning rate into its velocity, so under a learning-rate schedule the two differ.";
      }
      return base;
    }
    if (framework === "keras") {
      return "Keras's Adam adds epsilon (ε̂) to the uncorrected √s; QHAdam adds ε after bias correction. " +
        "With the same value they agree up to the first steps' ε, exactly as ε → 0.";
    }
    return "Same trajectory as torch.optim.Adam and optax.adam (ε after bias correction in all three).";
  }

  function suggestedNote(input, answer) {
    if (input.optimizer === "sgd") {
      return "The paper's rule of thumb (Sec. 7.1): ν = 0.7, β = 0.999 at the converted learning rate, " +
        "which keeps the effective step size. Tune from here.";
    }
    var text = "The paper's QH default (ν₁ = 0.7, β₁ = 0.999) with ν₂ = 1 and β₂, lr, ε unchanged " +
      "(Sec. 5 and 7.1).";
    if (answer.suggested.bound === null) {
      text += " Here β₁ = 0.999 ≥ √β₂, so the per-step update is not bounded (Analysis page); " +
        "the paper's WMT16 run with β₂ = 0.98 used β₁ = 0.95, ν₁ = 0.8, ν₂ = 0.7.";
    }
    return text;
  }

  function init() {
    var root = document.getElementById("qh-advisor");
    if (!root) return;
    var form = root.querySelector("form");
    form.addEventListener("input", render);
    form.addEventListener("change", render);
    form.addEventListener("submit", function (e) { e.preventDefault(); render(); });
    render();
    root.setAttribute("data-ready", "true");
  }

  window.qhAdvisor = { advise: advise, render: render, pyrepr: pyrepr, qhadamBound: qhadamBound };
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
