//! Training-log reading: non-finite loss-like metrics (the NaN trigger), loss values per step
//! (the curve), and mixed-precision precursors (overflow, loss-scale reductions).
//!
//! Recognised formats, with examples, are in docs/log-formats.md and in the corpus test below.
use std::sync::LazyLock;

use regex::Regex;

/// What one log line says.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LineScan {
    /// The metric that is NaN/Inf (`loss`, `grad_norm`...), or the pattern that matched.
    pub nonfinite: Option<String>,
    /// The non-finite value as the line writes it (`nan`, `inf`, `-inf`), when a metric named it.
    pub value: Option<String>,
    pub step: Option<u64>,
    pub loss: Option<f64>,
    pub loss_scale: Option<f64>,
    /// Gradient overflow / skipped step / loss-scale reduction (a precursor, not a trigger).
    pub overflow: bool,
    /// The non-finite value is a gradient norm and the loss is finite (or absent): see
    /// [`GradRule`] for when that is the incident.
    pub grad_only: bool,
}

/// A non-finite gradient norm with a finite loss: the incident, or the loss scaler's routine
/// skip? `Auto` (default): a precursor only when the log shows the scaler skipped that step
/// (an overflow/skip message in the same line or the 10 lines before, a skipped-iterations
/// count, or the loss scale dropping); otherwise the incident (bf16 has no scaler: NaN
/// gradients go into the weights).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GradRule {
    #[default]
    Auto,
    Incident,
    Precursor,
}

const NONFINITE: &str = r"[-+]?(?:nan|inf(?:inity)?)";
/// Loss-like metric names, with optional prefixes (`train_`, `lm `, `train/`) and suffixes.
const METRIC: &str = r"(?:[a-z0-9]+[_ /.-])?(?:[a-z0-9]+[_ ])?(?:loss|grad[_ ]?norm|gradient[_ ]norm|ppl|perplexity|nll)(?:[_/.-][a-z0-9]+){0,2}";

static NONFINITE_METRIC: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(&format!(
        r#"(?i)(?:^|[^a-z0-9_])({METRIC})['"\]]?\s*(?:[:=]|(?-u:\b)is(?-u:\b)|(?-u:\b)was(?-u:\b)|(?-u:\b)became(?-u:\b)|\s)\s*(?:tensor\(\[?\s*)?['"]?({NONFINITE})(?-u:\b)"#
    ))
    .unwrap()
});
/// PyTorch anomaly detection and framework checks that name a non-finite value outright, and
/// fatal framework errors that end an overflow spiral or a divergence without a `nan` token.
static NONFINITE_ERROR: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"(?i)(returned (?:nan|inf) values in its \d+\w* output|The loss returned in `?training_step`? is (?:nan|inf)|Loss is (?:nan|inf)(?-u:\b)|non-finite loss|loss (?:is|became|was) non-finite|detected (?:nan|inf)(?:/(?:nan|inf))? in (?:the )?loss",
        r"|NanLossDuringTrainingError|NaN loss during training|Minimum loss scale reached|loss scale (?:is )?already at minimum|Current loss scale already at minimum|training (?:has )?diverged|model diverged|Loss diverged|loss exploded|gradients? (?:are|is|contains?) (?:inf/nan|nan/inf|nan|inf|non-finite)",
        r"|AssertionError:.*(?-u:\b)(?:nan|NaN|inf|non-finite|isfinite|isnan)(?-u:\b).*(?-u:\b)(?:loss|grad|norm)|AssertionError:.*(?-u:\b)(?:loss|grad|norm)\w*(?-u:\b).*(?-u:\b)(?:nan|NaN|is not finite|non-finite|isfinite|isnan)",
        r"|FloatingPointError:.*(?-u:\b)(?:loss|grad|norm|nan|inf|overflow|scale)",
        r"|tensor\(\s*(?:nan|inf|-inf)(?-u:\b)[^)]*grad_fn=<\w*(?:Loss|Nll|Entropy|Mse|Mean|Sum|Div|Add|Mul)\w*Backward\d*>",
        r"|(?-u:\b)loss(?-u:\b)[^\n]{0,40}tensor\(\s*\[?\s*(?:nan|inf|-inf)(?-u:\b)",
        r"|Invalid loss, terminating training|found NaN in (?:the )?(?:local )?grad|Unexpected result nan|(?-u:\b)(?:outputs?|predictions?|logits)(?-u:\b)[^\n]{0,20}(?-u:\b)(?:is|are|contains?|has|became)\s+nan(?-u:\b)",
        r"|^\s*\d+/\d+\s+[\d.]+G\s+(?:nan|inf)\s)"
    ))
    .unwrap()
});
/// A line of source code (a traceback's frame, `raise ...`, `assert ...`): it names NaN checks
/// without reporting one.
static SOURCE_LINE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s+(?:raise|assert|if|elif|while|return|print|logger\.\w+|logging\.\w+|log\.\w+)(?-u:\b)|^\s*File \x22").unwrap()
});
/// A word that every non-finite pattern (metric or error) contains.
static NONFINITE_HINT: LazyLock<regex::bytes::Regex> = LazyLock::new(|| {
    regex::bytes::RegexBuilder::new(r"(?i)nan|inf|diverg|explod|minimum|finite|invalid loss")
        .unicode(false)
        .build()
        .expect("hint compiles")
});
/// Metric names whose `inf` is an initial value in a config or state dump (`best_valid_loss: inf`).
static INITIAL_KEY: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(best|min|lowest|prev|previous|initial|init|last_best|patience)").unwrap()
});
static GRAD_KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)grad[_ ]?norm|gradient[_ ]norm|gnorm").unwrap());
/// The loss scaler skipped this step (Megatron prints the count in the same line).
static SKIPPED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)skipped (?:iterations|steps?)\s*[:=]\s*[1-9]|skipping (?:step|update)|overflow|inf checks|found inf").unwrap()
});
static STEP: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r#"(?i)(?:^|[^a-z0-9_])(?:global_step|step|iteration|iter|it)['"]?\s*[:= ]\s*\[?\s*(\d+)"#,
    )
    .unwrap()
});
static LOSS_VALUE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?i)(?:^|[^a-z0-9_])(?:(?:train|lm|total|training)[_ ])?loss['"]?\s*[:= ]\s*(?:tensor\(\s*)?['"]?([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))(?-u:\b)"#).unwrap()
});
static LOSS_SCALE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(?:reducing(?: loss scale)? to|setting loss scale to|loss[ _]scale(?:r)?)\s*[:=]?\s*(\d+(?:\.\d+)?(?:e[-+]?\d+)?)").unwrap()
});
static REDUCING: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(?:reducing(?: loss scale)? to|setting loss scale to)\s*:?\s*(\d+(?:\.\d+)?(?:e[-+]?\d+)?)").unwrap()
});
static OVERFLOW: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(gradient overflow|OVERFLOW!|overflow detected|Skipping step|reducing loss scale|setting loss scale to|Minimum loss scale reached|found inf or nan in grad|inf checks)").unwrap()
});
/// Counter-like names that are not metrics even when they contain the word (`nan_count`).
static COUNTER_KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)(count|num|number|skipped|scale|steps?$)").unwrap());

/// Scanner with the user's extra patterns (`--nan-pattern`).
#[derive(Clone, Debug, Default)]
pub struct Scanner {
    extra: Vec<Regex>,
    pub grad_rule: GradRule,
}

impl Scanner {
    pub fn new(extra: &[String]) -> Result<Self, regex::Error> {
        Ok(Self {
            extra: extra
                .iter()
                .map(|p| Regex::new(p))
                .collect::<Result<_, _>>()?,
            grad_rule: GradRule::Auto,
        })
    }

    pub fn scan(&self, line: &str) -> LineScan {
        let mut out = LineScan::default();
        // Every non-finite pattern names one of these words: one literal search (ASCII, no
        // Unicode tables) spares the expensive patterns on the lines that cannot match.
        let hint = NONFINITE_HINT.is_match(line.as_bytes());
        let source = hint && SOURCE_LINE.is_match(line);
        for c in NONFINITE_METRIC
            .captures_iter(line)
            .filter(|_| hint && !source)
        {
            let key = c[1].trim();
            if COUNTER_KEY.is_match(key) {
                continue;
            }
            // `best_valid_loss: inf` is where a minimum starts, not a divergence.
            let value = c[2].to_ascii_lowercase();
            if INITIAL_KEY.is_match(key) && value.trim_start_matches(['+', '-']).starts_with("inf")
            {
                continue;
            }
            out.nonfinite = Some(key.to_string());
            out.value = Some(value);
            break;
        }
        if out.nonfinite.is_none() && hint && !source {
            if let Some(m) = NONFINITE_ERROR.find(line) {
                out.nonfinite = Some(m.as_str().to_string());
            }
        }
        if out.nonfinite.is_none() {
            if let Some(r) = self.extra.iter().find(|r| r.is_match(line)) {
                out.nonfinite = Some(format!("pattern {}", r.as_str()));
            }
        }
        out.step = STEP.captures(line).and_then(|c| c[1].parse().ok());
        out.loss = LOSS_VALUE.captures(line).and_then(|c| {
            let v = c[1].to_ascii_lowercase();
            match v.as_str() {
                "nan" => Some(f64::NAN),
                "inf" => Some(f64::INFINITY),
                _ => v.parse().ok(),
            }
        });
        out.overflow = OVERFLOW.is_match(line)
            || (out
                .nonfinite
                .as_deref()
                .is_some_and(|k| GRAD_KEY.is_match(k))
                && SKIPPED.is_match(line));
        out.grad_only = out
            .nonfinite
            .as_deref()
            .is_some_and(|k| GRAD_KEY.is_match(k))
            && out.loss.is_none_or(f64::is_finite);
        out.loss_scale = REDUCING
            .captures(line)
            .or_else(|| LOSS_SCALE.captures(line))
            .and_then(|c| c[1].parse().ok());
        out
    }
}

/// What is non-finite in a line the scanner flagged, for a person: `grad_norm = inf`,
/// `loss = nan`, or the framework's own words; and whether it is a NaN (not an Inf). A line
/// whose loss is finite but whose gradient norm is inf is not "the first NaN" (the demo's
/// `step 74 | loss 4.98e36 | grad_norm inf`).
pub fn describe(line: &str) -> Option<(String, bool)> {
    let s = Scanner {
        extra: Vec::new(),
        grad_rule: GradRule::Auto,
    }
    .scan(line);
    let what = s.nonfinite?;
    Some(match s.value {
        Some(v) => {
            let nan = v.trim_start_matches(['+', '-']).starts_with("nan");
            (format!("{what} = {v}"), nan)
        }
        None => {
            let nan = what.to_ascii_lowercase().contains("nan");
            (what.chars().take(80).collect(), nan)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_non_finite_is_named() {
        assert_eq!(
            describe("step 74 | loss 4.98e36 | grad_norm inf"),
            Some(("grad_norm = inf".into(), false))
        );
        assert_eq!(
            describe("step 1200 | loss nan | lr 3.0e-04"),
            Some(("loss = nan".into(), true))
        );
        assert_eq!(
            describe("{'loss': NaN, 'grad_norm': 1.2}"),
            Some(("loss = nan".into(), true))
        );
        assert_eq!(describe("step 3 | loss 2.1"), None);
    }

    /// (line, expected non-finite trigger?) — real shapes from PyTorch, HF Trainer, Lightning,
    /// Keras, Megatron-LM, DeepSpeed, fairseq, nanoGPT, JAX/Flax loops, and traps.
    const CORPUS: &[(&str, bool)] = &[
        ("{'loss': nan, 'grad_norm': nan, 'learning_rate': 4.5e-05, 'epoch': 0.52}", true),
        ("{'loss': 2.3456, 'grad_norm': 1.02, 'learning_rate': 4.5e-05, 'epoch': 0.5}", false),
        (r#"{"step": 1200, "loss": NaN, "lr": 0.0003}"#, true),
        ("step 1200 | loss nan | lr 3.0e-04 | 120.3 ms/it", true),
        ("iter 2000: loss nan, time 35.12ms, mfu 41.20%", true),
        ("iter 2000: loss 3.2124, time 35.12ms, mfu 41.20%", false),
        (" iteration     1000/  500000 | consumed samples: 512000 | elapsed time per iteration (ms): 412.3 | learning rate: 2.999E-04 | global batch size:   512 | lm loss: NAN | loss scale: 1.0 | grad norm: nan | number of skipped iterations:   0 | number of nan iterations:   1 |", true),
        (" iteration     1000/  500000 | lm loss: 2.104512E+00 | loss scale: 65536.0 | grad norm: 0.812 | number of skipped iterations:   0 | number of nan iterations:   0 |", false),
        ("Epoch 3: 45%|████▌     | 450/1000 [01:23<01:42, 5.37it/s, loss=nan, v_num=0]", true),
        ("Epoch 3: 45%|████▌     | 450/1000 [01:23<01:42, 5.37it/s, loss=0.693, v_num=0]", false),
        ("100/100 [==============================] - 2s 18ms/step - loss: nan - accuracy: 0.1000", true),
        ("100/100 [==============================] - 2s 18ms/step - loss: 0.2345 - accuracy: 0.9100 - val_loss: 0.31", false),
        ("Epoch 5/10 - loss: 0.123 - val_loss: -nan", true),
        ("train_loss=inf val_loss=2.3", true),
        ("step: 10, loss: tensor(nan, device='cuda:0', grad_fn=<NllLossBackward0>)", true),
        ("loss tensor(2.3010, device='cuda:0', grad_fn=<NllLossBackward0>)", false),
        ("RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output.", true),
        ("ValueError: The loss returned in `training_step` is nan.", true),
        ("train/loss: nan  train/ppl: inf", true),
        ("| epoch 001 | loss 4.123 | nll_loss 3.9 | ppl 14.9 | wps 12000 | ups 1.2 | wpb 1024 | bsz 8 | num_updates 100 | lr 0.0005 | gnorm 1.234 | loss_scale 64", false),
        ("| epoch 001:   1000 / 3000 loss=nan, nll_loss=nan, ppl=nan, wps=100", true),
        ("Loss is nan, stopping training", true),
        // Traps: words containing "nan", counters, units, unrelated inf.
        ("number of nan iterations: 0", false),
        ("nan_count: 0", false),
        ("Cloning into 'nanoGPT'...", false),
        ("timer resolution 1 nanoseconds", false),
        ("loading finance dataset from /data/finance/nanjing.parquet", false),
        ("INFO: loss scale info: dynamic", false),
        ("skipped nan steps: 0", false),
        ("[INFO] step 5 done in 12 ns", false),
        // Fatal framework errors with no metric token.
        ("AssertionError: loss is nan at step 1200", true),
        ("AssertionError: grad norm is not finite", true),
        ("FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. Try lowering the learning rate, using gradient clipping or increasing the batch size.", true),
        ("tensorflow.python.training.basic_session_run_hooks.NanLossDuringTrainingError: NaN loss during training.", true),
        ("Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.", true),
        ("RuntimeError: training diverged at step 3400", true),
        ("tensor(nan, device='cuda:0', grad_fn=<NllLossBackward0>)", true),
        // Initial values in config/state dumps.
        ("best_valid_loss: inf", false),
        ("{'best_loss': inf, 'patience': 3}", false),
        ("min_val_loss = inf", false),
        // Precursors do not trigger.
        ("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768", false),
        ("gradient overflow detected, ignoring gradient, setting loss scale to: 64.0", false),
        ("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0", false),
    ];

    #[test]
    fn corpus_outcomes() {
        let s = Scanner::default();
        let mut wrong = Vec::new();
        for (line, want) in CORPUS {
            let got = s.scan(line).nonfinite;
            if got.is_some() != *want {
                wrong.push(format!("{line:?}: expected trigger={want}, got {got:?}"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn metric_names_are_reported() {
        let s = Scanner::default();
        assert_eq!(s.scan("{'loss': nan}").nonfinite.as_deref(), Some("loss"));
        assert_eq!(
            s.scan("grad norm: inf | lm loss: 2.0").nonfinite.as_deref(),
            Some("grad norm")
        );
        assert_eq!(
            s.scan("val_loss=-nan").nonfinite.as_deref(),
            Some("val_loss")
        );
    }

    #[test]
    fn steps_and_losses_for_the_curve() {
        let s = Scanner::default();
        let a = s.scan("step 1200 | loss 2.5e-01 | lr 3.0e-04");
        assert_eq!((a.step, a.loss), (Some(1200), Some(0.25)));
        let b = s.scan("iter 2000: loss 3.2124, time 35.12ms");
        assert_eq!((b.step, b.loss), (Some(2000), Some(3.2124)));
        let c =
            s.scan(" iteration     1000/  500000 | lm loss: 2.104512E+00 | loss scale: 65536.0 |");
        assert_eq!(
            (c.step, c.loss, c.loss_scale),
            (Some(1000), Some(2.104512), Some(65536.0))
        );
        let d = s.scan("{'loss': nan, 'epoch': 0.5}");
        assert!(d.loss.unwrap().is_nan());
        assert_eq!(s.scan("Epoch 3/10").step, None);
    }

    #[test]
    fn precursors() {
        let s = Scanner::default();
        let d = s.scan("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768");
        assert!(d.overflow);
        assert_eq!(d.loss_scale, Some(32768.0));
        let f =
            s.scan("gradient overflow detected, ignoring gradient, setting loss scale to: 64.0");
        assert_eq!((f.overflow, f.loss_scale), (true, Some(64.0)));
        assert!(!s.scan("step 3 | loss 1.0").overflow);
    }

    #[test]
    fn user_pattern() {
        let s = Scanner::new(&["WEIGHTS BLEW UP at step".to_string()]).unwrap();
        assert!(s
            .scan("WEIGHTS BLEW UP at step 17")
            .nonfinite
            .unwrap()
            .starts_with("pattern"));
        assert!(Scanner::new(&["(".to_string()]).is_err());
    }
}
