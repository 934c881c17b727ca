//! The codecs this build has: one line per codec file, gated by its cargo
//! feature, so a new codec is its file and its line here. Everything that
//! asks "is zstd built?" or "give me a deflate decoder" asks here.

use super::backend::{Backend, PageDecoder, PageEncoder, Trainer};
use super::dictionary::CodecDictionary;
use super::error::CodecError;
use super::id::{CodecChoice, CodecId, CodecImpl};
use super::qpl_path::QplPath;

/// Every codec file's backends, as its feature allows.
const REGISTERED: &[&[Backend]] = &[
    #[cfg(feature = "zstd")]
    super::zstd::BACKENDS,
    #[cfg(feature = "deflate")]
    super::deflate::BACKENDS,
    #[cfg(feature = "lz4")]
    super::lz4::BACKENDS,
    #[cfg(feature = "qpl")]
    super::qpl::BACKENDS,
];

/// The backend of an implementation, if this build has it.
fn find(which: CodecImpl) -> Option<&'static Backend> {
    REGISTERED
        .iter()
        .flat_map(|backends| backends.iter())
        .find(|backend| backend.implementation == which)
}

/// The error for an implementation this build lacks: the feature named as
/// the codec is ([`CodecId::name`], or `qpl`).
fn not_built(which: CodecImpl) -> CodecError {
    CodecError::NotBuilt {
        feature: match which {
            CodecImpl::Qpl => "qpl",
            other => other.wire().name(),
        },
    }
}

/// A worker's encoder for `which` (not [`CodecImpl::None`]) at `level`
/// (clamped to the wire codec's range), with the dictionary and QPL path
/// for the codecs that take them.
pub(crate) fn encoder(
    which: CodecImpl,
    level: i32,
    dictionary: Option<&CodecDictionary>,
    qpl_path: QplPath,
) -> Result<Box<dyn PageEncoder>, CodecError> {
    let backend = find(which).ok_or_else(|| not_built(which))?;
    (backend.encoder)(level, dictionary, qpl_path)
}

/// A receiver's decoder for `which` (not [`CodecImpl::None`]).
pub(crate) fn decoder(which: CodecImpl) -> Result<Box<dyn PageDecoder>, CodecError> {
    let backend = find(which).ok_or_else(|| not_built(which))?;
    (backend.decoder)()
}

/// The dictionary trainer of `codec`'s implementation.
pub(crate) fn trainer(codec: CodecId) -> Result<Trainer, CodecError> {
    let which = CodecImpl::software(codec);
    let backend = find(which).ok_or_else(|| not_built(which))?;
    backend
        .trainer
        .ok_or_else(|| CodecError::Dictionary(format!("{codec} takes no dictionary")))
}

/// Whether libqpl can be loaded; without the `qpl` feature never:
/// [`CodecError::NotBuilt`].
///
/// # Errors
///
/// [`CodecError::NotBuilt`], [`CodecError::QplUnavailable`] or
/// [`CodecError::QplUnsupported`], saying why QPL cannot be used.
pub fn qpl_available() -> Result<(), CodecError> {
    let backend = find(CodecImpl::Qpl).ok_or_else(|| not_built(CodecImpl::Qpl))?;
    backend.available.map_or(Ok(()), |available| available())
}

impl CodecImpl {
    /// Whether this build of tern-page has the implementation (its cargo
    /// feature was on). [`CodecImpl::None`] always is.
    pub fn is_built(self) -> bool {
        self == CodecImpl::None || find(self).is_some()
    }
}

impl CodecId {
    /// Whether this build of tern-page has the codec (its cargo feature was
    /// on). [`CodecId::None`] always is.
    pub fn is_built(self) -> bool {
        CodecImpl::software(self).is_built()
    }

    /// [`is_built`](Self::is_built) as a result, with the error that names
    /// the missing feature.
    ///
    /// # Errors
    ///
    /// [`CodecError::NotBuilt`].
    pub fn check_built(self) -> Result<(), CodecError> {
        if self.is_built() {
            Ok(())
        } else {
            Err(not_built(CodecImpl::software(self)))
        }
    }
}

impl CodecChoice {
    /// Whether this build of tern-page has what the choice needs (`auto`
    /// always is: it only picks among the codecs built).
    pub fn is_built(self) -> bool {
        match self {
            CodecChoice::Qpl => CodecImpl::Qpl.is_built(),
            CodecChoice::Auto => true,
            other => other.wire().is_some_and(CodecId::is_built),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{REGISTERED, find};
    use crate::codec::id::CodecImpl;

    #[test]
    fn each_codec_is_registered_once_exactly_when_its_feature_is_on() {
        let features = [
            (CodecImpl::Zstd, cfg!(feature = "zstd")),
            (CodecImpl::ZstdPacket, cfg!(feature = "zstd")),
            (CodecImpl::ZstdStream, cfg!(feature = "zstd")),
            (CodecImpl::Deflate, cfg!(feature = "deflate")),
            (CodecImpl::Lz4, cfg!(feature = "lz4")),
            (CodecImpl::Qpl, cfg!(feature = "qpl")),
        ];
        for (which, on) in features {
            assert_eq!(find(which).is_some(), on, "{which:?}");
            assert_eq!(which.is_built(), on, "{which:?}");
        }
        for which in CodecImpl::ALL {
            let entries = REGISTERED
                .iter()
                .flat_map(|backends| backends.iter())
                .filter(|backend| backend.implementation == which)
                .count();
            assert!(entries <= 1, "{which:?} registered {entries} times");
        }
        assert!(find(CodecImpl::None).is_none(), "none is no codec");
        assert!(CodecImpl::None.is_built());
    }
}
