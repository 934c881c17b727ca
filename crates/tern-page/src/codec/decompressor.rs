//! [`PageDecompressor`]: one receiver's decoder, whatever the codec, and
//! the destination's choice of inflate.

use std::fmt;

use super::backend::PageDecoder;
use super::batch::MAX_COMPRESSED;
use super::dictionary::CodecDictionary;
use super::error::CodecError;
use super::id::{CodecId, CodecImpl};
use super::qpl_path::QplPath;
use super::registry;
use crate::PAGE_SIZE;

/// Decodes single pages. One per receiver thread; receivers decode in
/// parallel, each page on its own.
pub struct PageDecompressor {
    codec: CodecId,
    which: CodecImpl,
    /// The codec's decoder; `None` for [`CodecId::None`].
    engine: Option<Box<dyn PageDecoder>>,
}

impl fmt::Debug for PageDecompressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageDecompressor")
            .field("codec", &self.codec)
            .field("implementation", &self.which)
            .finish_non_exhaustive()
    }
}

/// Which inflate the destination uses for deflate pages, from its QPL path
/// (`--qpl-path`) and an attempt to open QPL's hardware path
/// (`open_hardware`, called only when the path allows IAA). Pure apart from
/// that call:
///
/// * `software`: libdeflate (QPL's software inflate gains nothing over it);
/// * `auto`: IAA when it opens, libdeflate otherwise;
/// * `hardware`: IAA, or the error that says why it cannot be had.
///
/// `Some` is the opened hardware engine, `None` libdeflate.
pub fn choose_inflate<T>(
    path: QplPath,
    open_hardware: impl FnOnce() -> Result<T, CodecError>,
) -> Result<Option<T>, CodecError> {
    match path {
        QplPath::Software => Ok(None),
        QplPath::Auto => Ok(open_hardware().ok()),
        QplPath::Hardware => open_hardware().map(Some),
    }
}

impl PageDecompressor {
    /// A decoder for the session's wire codec. A session whose pages came
    /// from QPL uses [`CodecId::Deflate`].
    ///
    /// # Errors
    ///
    /// [`CodecError::NotBuilt`] for a codec whose feature is off;
    /// [`CodecError::Init`] if the codec library cannot start.
    pub fn new(codec: CodecId) -> Result<Self, CodecError> {
        Self::with_decoder(codec, CodecImpl::software(codec))
    }

    fn with_decoder(codec: CodecId, which: CodecImpl) -> Result<Self, CodecError> {
        let engine = match which {
            CodecImpl::None => None,
            which => Some(registry::decoder(which)?),
        };
        Ok(Self {
            codec,
            which,
            engine,
        })
    }

    /// A destination's decoder for `codec`: for deflate, IAA through QPL
    /// when `qpl_path` allows it and the hardware opens (see
    /// [`choose_inflate`]), libdeflate otherwise; other codecs as
    /// [`new`](Self::new).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new); with [`QplPath::Hardware`], why IAA cannot be
    /// used ([`CodecError::QplUnavailable`], a QPL status, or
    /// [`CodecError::NotBuilt`] without the `qpl` feature).
    pub fn for_destination(codec: CodecId, qpl_path: QplPath) -> Result<Self, CodecError> {
        // IAA's inflate speaks deflate only.
        if codec != CodecImpl::Qpl.wire() {
            return Self::new(codec);
        }
        let hardware = choose_inflate(qpl_path, || Self::with_decoder(codec, CodecImpl::Qpl))?;
        match hardware {
            Some(iaa) => Ok(iaa),
            None => Self::new(codec),
        }
    }

    /// Adds the session's dictionaries, so packets may name them (zstd;
    /// other codecs take none).
    ///
    /// # Errors
    ///
    /// [`CodecError::Dictionary`] when libzstd rejects one.
    pub fn with_dictionaries(
        mut self,
        dictionaries: &[CodecDictionary],
    ) -> Result<Self, CodecError> {
        self.add_dictionaries(dictionaries)?;
        Ok(self)
    }

    /// Adds dictionaries to a decoder in use (a refresh during the
    /// session); one with the id of a known one replaces it.
    ///
    /// # Errors
    ///
    /// [`CodecError::Dictionary`] when libzstd rejects one.
    pub fn add_dictionaries(&mut self, dictionaries: &[CodecDictionary]) -> Result<(), CodecError> {
        if let Some(engine) = self.engine.as_mut() {
            for dictionary in dictionaries {
                engine.add_dictionary(dictionary)?;
            }
        }
        Ok(())
    }

    /// Decodes the frame of a [`CodecId::ZstdPacket`] packet made with
    /// dictionary `dictionary` (0: none) into exactly `pages` pages, and
    /// returns them back to back. Never decodes more than `pages` ×
    /// `PAGE_SIZE` bytes; any other size is an error.
    ///
    /// # Errors
    ///
    /// [`CodecError::PacketSize`], [`CodecError::Malformed`],
    /// [`CodecError::UnknownDictionary`], [`CodecError::BadInputLength`]
    /// for a frame no shorter than its pages; [`CodecError::NoCodec`] for a
    /// decoder of another codec.
    pub fn decompress_packet(
        &mut self,
        frame: &[u8],
        dictionary: u8,
        pages: usize,
    ) -> Result<&[u8], CodecError> {
        match self.engine.as_mut() {
            Some(engine) => engine.decompress_packet(frame, dictionary, pages),
            None => Err(CodecError::NoCodec),
        }
    }

    /// The wire codec this decoder reads.
    pub fn codec(&self) -> CodecId {
        self.codec
    }

    /// What decodes: [`CodecImpl::Qpl`] when deflate pages go to IAA.
    pub fn implementation(&self) -> CodecImpl {
        self.which
    }

    /// Pages the offload engine did not decode, so libdeflate did.
    pub fn offload_fallbacks(&self) -> u64 {
        self.engine
            .as_ref()
            .map_or(0, |engine| engine.offload_fallbacks())
    }

    /// Decodes one compressed page into `out`. Errors unless `input` is a
    /// valid stream of 1..=`PAGE_SIZE - 1` bytes decoding to exactly
    /// `PAGE_SIZE` bytes. On error `out` holds unspecified bytes (the
    /// migration fails anyway); nothing outside `out` is ever written.
    pub fn decompress(
        &mut self,
        input: &[u8],
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CodecError> {
        self.decompress_with(input, 0, out)
    }

    /// [`decompress`](Self::decompress) of a page compressed against
    /// dictionary `dictionary` (0: none), which must be one of
    /// [`with_dictionaries`](Self::with_dictionaries)'s.
    pub fn decompress_with(
        &mut self,
        input: &[u8],
        dictionary: u8,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CodecError> {
        let codec = self.codec.name();
        let Some(engine) = self.engine.as_mut() else {
            return Err(CodecError::NoCodec);
        };
        if input.is_empty() || input.len() > MAX_COMPRESSED {
            return Err(CodecError::BadInputLength {
                codec,
                len: input.len(),
            });
        }
        if dictionary != 0 && !self.codec.is_zstd() {
            return Err(CodecError::UnknownDictionary {
                codec,
                id: dictionary,
            });
        }
        // Every decoder takes `out` as an exact-size slice and checks each
        // write against its length.
        let decoded = engine.decompress(input, dictionary, out)?;
        if decoded != PAGE_SIZE {
            return Err(CodecError::ShortPage { codec, decoded });
        }
        Ok(())
    }

    /// [`decompress`](Self::decompress) straight into guest memory, no
    /// bounce buffer.
    ///
    /// # Safety
    ///
    /// `page_out` must point to [`PAGE_SIZE`] writable bytes that no other
    /// thread reads or writes during the call (on the destination the guest
    /// is not running and each page belongs to one receiver per iteration).
    pub unsafe fn decompress_page(
        &mut self,
        input: &[u8],
        page_out: *mut u8,
    ) -> Result<(), CodecError> {
        // SAFETY: forwarded caller contract.
        unsafe { self.decompress_page_with(input, 0, page_out) }
    }

    /// [`decompress_page`](Self::decompress_page) of a page compressed
    /// against dictionary `dictionary` (0: none).
    ///
    /// # Safety
    ///
    /// As [`decompress_page`](Self::decompress_page).
    pub unsafe fn decompress_page_with(
        &mut self,
        input: &[u8],
        dictionary: u8,
        page_out: *mut u8,
    ) -> Result<(), CodecError> {
        // SAFETY: the caller guarantees PAGE_SIZE writable, unaliased bytes
        // at `page_out`, and u8 has alignment 1. The decoders write only
        // through this exact-size reference and bound every write by its
        // length, so nothing past the page can be written.
        let out = unsafe { &mut *page_out.cast::<[u8; PAGE_SIZE]>() };
        self.decompress_with(input, dictionary, out)
    }
}

#[cfg(test)]
mod feature_tests {
    use super::{PageDecompressor, choose_inflate};
    use crate::PAGE_SIZE;
    use crate::codec::{
        CodecChoice, CodecError, CodecId, CodecImpl, MAX_COMPRESSED, PageCompressor, QplPath,
        qpl_available,
    };

    /// Stands in for QPL's hardware path in [`choose_inflate`].
    #[derive(Debug, PartialEq)]
    struct StandInIaa;

    fn no_iaa() -> Result<StandInIaa, CodecError> {
        Err(CodecError::QplUnavailable("no IAA work queue".into()))
    }

    #[test]
    fn the_destination_inflates_on_iaa_only_when_its_path_allows_and_iaa_opens() {
        let never = || -> Result<StandInIaa, CodecError> {
            panic!("the software path must not open the hardware")
        };
        assert_eq!(choose_inflate(QplPath::Software, never).unwrap(), None);
        assert_eq!(choose_inflate(QplPath::Auto, no_iaa).unwrap(), None);
        assert_eq!(
            choose_inflate(QplPath::Auto, || Ok(StandInIaa)).unwrap(),
            Some(StandInIaa)
        );
        assert_eq!(
            choose_inflate(QplPath::Hardware, || Ok(StandInIaa)).unwrap(),
            Some(StandInIaa)
        );
        let error = choose_inflate(QplPath::Hardware, no_iaa).unwrap_err();
        assert!(error.to_string().contains("no IAA work queue"), "{error}");
    }

    #[test]
    fn without_iaa_the_destination_inflates_with_libdeflate() {
        if qpl_available().is_ok() {
            tern_test_skip::skip(
                tern_test_skip::Need::NoQpl,
                "libqpl loads here; this checks the machine without it",
            );
            return;
        }
        if !CodecId::Deflate.is_built() {
            tern_test_skip::skip(
                tern_test_skip::Need::Host,
                "tern-page built without the deflate feature",
            );
            return;
        }
        let mut page = [0u8; PAGE_SIZE];
        for (i, byte) in page.iter_mut().enumerate() {
            *byte = u8::try_from(i / 64).unwrap_or(u8::MAX);
        }
        let mut compressed = [0u8; MAX_COMPRESSED];
        let len = PageCompressor::new(CodecId::Deflate, 1)
            .unwrap()
            .compress(&page, &mut compressed)
            .expect("compressible");
        for path in [QplPath::Auto, QplPath::Software] {
            let mut decoder = PageDecompressor::for_destination(CodecId::Deflate, path).unwrap();
            assert_eq!(decoder.implementation(), CodecImpl::Deflate);
            let mut out = [0u8; PAGE_SIZE];
            decoder.decompress(&compressed[..len], &mut out).unwrap();
            assert_eq!(out, page);
            assert_eq!(decoder.offload_fallbacks(), 0);
        }
        let error = PageDecompressor::for_destination(CodecId::Deflate, QplPath::Hardware)
            .expect_err("asked for IAA without libqpl");
        assert!(
            matches!(
                error,
                CodecError::QplUnavailable(_) | CodecError::NotBuilt { .. }
            ),
            "{error}"
        );
        // Other codecs are not affected by the QPL path.
        let zstd = PageDecompressor::for_destination(CodecId::Zstd, QplPath::Hardware);
        assert_eq!(zstd.is_ok(), CodecId::Zstd.is_built());
    }

    #[test]
    fn a_codec_left_out_is_a_typed_error_naming_its_feature() {
        for codec in CodecId::ALL {
            let compressor = PageCompressor::new(codec, 1);
            let decompressor = PageDecompressor::new(codec);
            assert_eq!(compressor.is_ok(), codec.is_built(), "{codec}");
            assert_eq!(decompressor.is_ok(), codec.is_built(), "{codec}");
            if let Err(e) = compressor {
                assert!(
                    matches!(e, CodecError::NotBuilt { feature } if feature == codec.name()),
                    "{e}"
                );
                assert_eq!(
                    e.to_string(),
                    format!("tern-page was built without the {codec} feature")
                );
            }
        }
        let qpl = PageCompressor::with_qpl(QplPath::Auto, 1);
        if !cfg!(feature = "qpl") {
            assert!(matches!(qpl, Err(CodecError::NotBuilt { feature: "qpl" })));
            assert!(matches!(
                qpl_available(),
                Err(CodecError::NotBuilt { feature: "qpl" })
            ));
        }
        assert_eq!(CodecChoice::Qpl.is_built(), cfg!(feature = "qpl"));
        assert!(CodecChoice::Auto.is_built());
    }
}
