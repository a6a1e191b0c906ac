//! Storage quantities ("1Gi", "500M", "1.5Gi", "2e9") as whole bytes, rounded up as Kubernetes
//! rounds storage requests. Unparsable input yields `None`, never a panic.

/// Bytes of a quantity string, rounded up; `None` when it is not a valid quantity.
pub fn bytes(q: &str) -> Option<u128> {
    let q = q.trim();
    if q.is_empty() || q.starts_with('-') {
        return None;
    }
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let (mult_num, mult_den): (u128, u128) = match suffix {
        "" => (1, 1),
        "m" => (1, 1000),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        s if s.starts_with(['e', 'E']) => {
            let exp: u32 = s[1..].parse().ok().filter(|e| *e <= 30)?;
            (10u128.checked_pow(exp)?, 1)
        }
        _ => return None,
    };
    let num = num.strip_prefix('+').unwrap_or(num);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.len() > 18 {
        return None;
    }
    let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let frac_den = 10u128.pow(u32::try_from(frac.len()).ok()?);
    let frac: u128 = if frac.is_empty() { 0 } else { frac.parse().ok()? };
    // value = (int + frac/frac_den) * mult_num / mult_den, rounded up
    let numer = int
        .checked_mul(frac_den)?
        .checked_add(frac)?
        .checked_mul(mult_num)?;
    let denom = frac_den.checked_mul(mult_den)?;
    Some(numer.div_ceil(denom))
}

#[cfg(test)]
mod tests {
    use super::bytes;

    #[test]
    fn common_forms() {
        assert_eq!(bytes("1Gi"), Some(1 << 30));
        assert_eq!(bytes("64Mi"), Some(64 << 20));
        assert_eq!(bytes("500M"), Some(500_000_000));
        assert_eq!(bytes("1.5Gi"), Some(3 << 29));
        assert_eq!(bytes("2e3"), Some(2000));
        assert_eq!(bytes("1500m"), Some(2));
        assert_eq!(bytes("100"), Some(100));
        assert_eq!(bytes("0"), Some(0));
    }

    #[test]
    fn odd_input_is_none_not_a_panic() {
        for q in [
            "",
            "Gi",
            "-1Gi",
            "1Qi",
            "1.2.3",
            "1e99",
            "99999999999999999999999999999999999999999999Ei",
            ".",
        ] {
            assert_eq!(bytes(q), None, "{q}");
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "\\PC{0,24}") {
            let _ = bytes(&s);
        }

        #[test]
        fn binary_suffixes_scale(n in 0u64..1_000_000) {
            proptest::prop_assert_eq!(bytes(&format!("{n}Mi")), Some(u128::from(n) << 20));
            proptest::prop_assert_eq!(bytes(&format!("{n}Ki")).map(|b| b * 1024), bytes(&format!("{n}Mi")));
        }
    }
}
