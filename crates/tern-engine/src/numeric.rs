//! Numeric conversions the workspace's cast lints ask to spell out, each
//! named for what it does with a value that does not fit. A value a peer
//! or a file declares is converted with `try_from` and a typed error where
//! it is read; these helpers are for values of our own (lengths, counts,
//! rates, a system call's result) where a clamp is the right answer.
//!
//! A leaf module: it imports nothing from the crate.

/// `value` as `usize`; values that do not fit (32-bit hosts) become
/// `usize::MAX`, which every bounds check (`get`, a slice, `min`) then
/// refuses or clamps. The identity on 64-bit hosts.
#[inline]
pub(crate) fn saturating_usize(value: u64) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

/// `value` as `u32`, `u32::MAX` when it does not fit. For lengths that are
/// at most a page (a compressed page, a delta) and counts bounded by the
/// protocol's 32-bit page indices, where the clamp never happens.
#[inline]
pub(crate) fn saturating_u32<T: TryInto<u32>>(value: T) -> u32 {
    value.try_into().unwrap_or(u32::MAX)
}

/// `value` as `u64`, `u64::MAX` when it does not fit: nanoseconds and
/// milliseconds of a `Duration` (`u128`) for reports and counters.
#[inline]
pub(crate) fn saturating_u64<T: TryInto<u64>>(value: T) -> u64 {
    value.try_into().unwrap_or(u64::MAX)
}

/// A rate, a ratio or a time in `f64` as a `u64`: negative values and NaN
/// become 0, values past `u64::MAX` become `u64::MAX`, fractions are cut.
#[inline]
pub(crate) fn saturating_u64_from_f64(value: f64) -> u64 {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "float-to-integer `as` saturates at both ends and maps NaN \
                  to 0: exactly the clamp documented above"
    )]
    let clamped = value as u64;
    clamped
}

/// The length of a `T` as the `socklen_t` a socket call takes.
pub(crate) const fn socklen_of<T>() -> libc::socklen_t {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the C structures handed to socket calls are at most a few \
                  hundred bytes, far below u32::MAX"
    )]
    let len = std::mem::size_of::<T>() as libc::socklen_t;
    len
}

/// The length of `value` as the `socklen_t` a socket call takes.
#[cfg(feature = "tls")]
pub(crate) const fn socklen_of_val<T>(_value: &T) -> libc::socklen_t {
    socklen_of::<T>()
}

/// The count a system call returned (`read`, `write`, `sendmsg`, …) once
/// the caller has checked it is not negative; a negative one becomes 0.
#[inline]
pub(crate) fn syscall_count(returned: isize) -> usize {
    usize::try_from(returned).unwrap_or(0)
}

/// A file offset as the `off_t` `pread`/`pwrite`/`fallocate` take; one
/// past `i64::MAX` (no file holds it) is an `InvalidInput` error.
#[inline]
pub(crate) fn file_offset(offset: u64) -> std::io::Result<libc::off_t> {
    libc::off_t::try_from(offset).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("file offset {offset} is past the largest file"),
        )
    })
}

/// The lowest byte of `value`: test patterns and fuzz seeds that cycle
/// through byte values on purpose.
#[inline]
pub(crate) fn low_byte(value: u64) -> u8 {
    value.to_le_bytes()[0]
}

#[cfg(test)]
mod tests {
    use super::{
        file_offset, low_byte, saturating_u32, saturating_u64, saturating_u64_from_f64,
        saturating_usize, socklen_of, syscall_count,
    };

    #[test]
    fn conversions_clamp_instead_of_wrapping() {
        assert_eq!(saturating_usize(7), 7);
        assert_eq!(saturating_u32(4096usize), 4096);
        assert_eq!(saturating_u32(u64::from(u32::MAX) + 1), u32::MAX);
        assert_eq!(saturating_u64(u128::from(u64::MAX) + 1), u64::MAX);
        assert_eq!(saturating_u64_from_f64(-1.0), 0);
        assert_eq!(saturating_u64_from_f64(f64::NAN), 0);
        assert_eq!(saturating_u64_from_f64(1e30), u64::MAX);
        assert_eq!(saturating_u64_from_f64(2.9), 2);
        assert_eq!(syscall_count(-1), 0);
        assert_eq!(syscall_count(12), 12);
        assert_eq!(low_byte(0x1234), 0x34);
        assert_eq!(file_offset(4096).ok(), Some(4096));
        assert!(file_offset(u64::MAX).is_err());
        assert_eq!(usize::try_from(socklen_of::<libc::c_int>()), Ok(4));
        #[cfg(feature = "tls")]
        assert_eq!(usize::try_from(super::socklen_of_val(b"tls")), Ok(3));
    }
}
