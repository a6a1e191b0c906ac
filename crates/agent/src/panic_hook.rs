//! A test hook, in debug builds only: `--debug-panic-once=<operation>:<pv>` makes the next
//! `<operation>` of that PV panic once, so tests prove a panicked operation is reported failed
//! (`stowage_common::runtime::owed`) and retried.

/// A test hook, in debug builds only: `--debug-panic-once=<operation>:<pv>` makes the next
/// `<operation>` (attach, mount) of that PV panic once, so tests can prove a panicked operation
/// is retried. Release builds have neither the flag nor the check.
#[cfg(debug_assertions)]
static PANIC_ONCE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

#[cfg(debug_assertions)]
pub(crate) fn arm(hooks: &[String]) {
    PANIC_ONCE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(hooks.iter().cloned());
}

/// Panics if the test hook asks for it (debug builds); does nothing otherwise.
pub(crate) fn test_hook(operation: &str, pv: &str) {
    #[cfg(debug_assertions)]
    {
        let want = format!("{operation}:{pv}");
        let fire = {
            let mut hooks = PANIC_ONCE.lock().unwrap_or_else(|p| p.into_inner());
            let at = hooks.iter().position(|h| *h == want);
            at.map(|i| hooks.remove(i)).is_some()
        };
        if fire {
            panic!("test hook: the {operation} of {pv} panics");
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = (operation, pv);
}
