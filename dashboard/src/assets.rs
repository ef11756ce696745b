//! The web dashboard's files, embedded in the binary so the page works offline.

/// `/`.
pub const INDEX_HTML: &str = include_str!("../assets/index.html");
/// `/assets/app.js`.
pub const APP_JS: &str = include_str!("../assets/app.js");
/// `/assets/style.css`.
pub const STYLE_CSS: &str = include_str!("../assets/style.css");
/// `/assets/vendor/uPlot.iife.min.js` (the charting library, vendored and pinned).
pub const UPLOT_JS: &str = include_str!("../assets/vendor/uPlot.iife.min.js");
/// `/assets/vendor/uPlot.min.css`.
pub const UPLOT_CSS: &str = include_str!("../assets/vendor/uPlot.min.css");
