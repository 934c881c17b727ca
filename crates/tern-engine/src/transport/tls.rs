//! TLS 1.3 over any stream transport: rustls for the handshake, then
//! either the kernel (kTLS) or rustls for the records.
//!
//! Certificates come from a directory of PEM files, the same layout on
//! both sides (docs/security.md shows how to make one with openssl):
//! `ca.pem` (the CA that signed the peer), `cert.pem` (this host's chain,
//! leaf first) and `key.pem` (its private key). Authentication is mutual:
//! the destination requires a client certificate from the same CA.
//!
//! Kernel TLS: after the handshake, the session keys may be handed to the
//! kernel (`TCP_ULP` "tls", then `SOL_TLS`/`TLS_TX`/`TLS_RX` with the
//! AES-GCM key, salt, IV and record sequence), so that pages still leave
//! with one `sendmsg` from guest memory and land with `readv` into it. That
//! needs the kernel's `tls` module; where it is missing (setting the ULP
//! fails), where the cipher is not AES-GCM, or where rustls already holds
//! received bytes, the channel stays in user space.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection,
};

use super::channel_security::{ChannelSecurity, TlsInfo};
use super::{Channel, Segment, Stream, TransferClock};
use crate::error::ChannelError;
use tern_wire::{FrameKind, Message};

pub use super::tls_types::{KernelTls, TlsError};

/// Certificates, trust and options for both roles.
#[derive(Clone)]
pub struct TlsConfig {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
    /// The name the source checks in the destination's certificate; `None`
    /// takes the host of the address.
    pub hostname: Option<String>,
    /// Kernel offload.
    pub kernel: KernelTls,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("hostname", &self.hostname)
            .field("kernel", &self.kernel)
            .finish_non_exhaustive()
    }
}

impl TlsConfig {
    /// Reads `ca.pem`, `cert.pem` and `key.pem` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, TlsError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|source| TlsError::Read {
                path: path.display().to_string(),
                source,
            })
        };
        Self::from_pem(&read("ca.pem")?, &read("cert.pem")?, &read("key.pem")?)
    }

    /// Builds both roles from PEM text: the CA to trust, this host's chain
    /// and its private key.
    pub fn from_pem(ca: &[u8], chain: &[u8], key: &[u8]) -> Result<Self, TlsError> {
        let roots = Arc::new(root_store(ca)?);
        let chain = certificates(chain, "cert.pem")?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|error| TlsError::Pem {
            what: "key.pem",
            detail: error.to_string(),
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(|error| TlsError::Pem {
                    what: "ca.pem",
                    detail: error.to_string(),
                })?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(TlsError::Rustls)?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(TlsError::Rustls)?;
        // No resumption: every channel proves its certificate, and a ticket
        // arriving after the handshake would reach a kTLS socket as a
        // record the kernel hands back as an error.
        server.send_tls13_tickets = 0;
        server.enable_secret_extraction = true;
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(TlsError::Rustls)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(TlsError::Rustls)?;
        client.enable_secret_extraction = true;
        client.resumption = rustls::client::Resumption::disabled();
        Ok(Self {
            client: Arc::new(client),
            server: Arc::new(server),
            hostname: None,
            kernel: KernelTls::Auto,
        })
    }
}

fn certificates(pem: &[u8], what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsError::Pem {
            what,
            detail: error.to_string(),
        })?;
    if certificates.is_empty() {
        return Err(TlsError::Pem {
            what,
            detail: "no certificate in it".into(),
        });
    }
    Ok(certificates)
}

fn root_store(pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for certificate in certificates(pem, "ca.pem")? {
        roots.add(certificate).map_err(TlsError::Rustls)?;
    }
    Ok(roots)
}

/// Runs the client handshake on `channel` (whose timeouts bound each
/// read) and checks `hostname` in the destination's certificate.
pub fn connect(
    channel: Channel,
    config: &TlsConfig,
    hostname: &str,
) -> Result<Channel, ChannelError> {
    let name = ServerName::try_from(hostname.to_string()).map_err(|error| {
        ChannelError::Tls(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("'{hostname}' is not a host name for TLS: {error}"),
        ))
    })?;
    let connection = ClientConnection::new(config.client.clone(), name)
        .map_err(|error| ChannelError::Tls(io::Error::other(error)))?;
    handshake(
        channel,
        Connection::Client(connection),
        config.kernel,
        Peer::Destination,
    )
}

/// Runs the server handshake on an accepted `channel`.
pub fn accept(channel: Channel, config: &TlsConfig) -> Result<Channel, ChannelError> {
    let connection = ServerConnection::new(config.server.clone())
        .map_err(|error| ChannelError::Tls(io::Error::other(error)))?;
    let socket = channel.into_socket()?;
    refuse_plaintext(&socket)?;
    handshake(
        Channel::new(Stream::Socket(socket))?,
        Connection::Server(connection),
        config.kernel,
        Peer::Source,
    )
}

/// The most a peer may send before its TLS handshake completes: its
/// hello and its certificate flight (a few KiB with tern's certificates,
/// under 16 KiB with a chain of several RSA-4096 certificates), and up to
/// 4 KiB of its first frame read with the last of them (rustls reads
/// 4 KiB at a time). rustls alone would buffer up to 64 KiB of
/// one handshake message from a peer that has proved nothing; with this
/// budget an unauthenticated connection costs at most 24 KiB of it
/// (docs/security.md, "Before authentication").
const HANDSHAKE_READ_BUDGET: usize = 24 << 10;

/// The socket as the handshake reads it: reads stop with an error once
/// the peer has sent [`HANDSHAKE_READ_BUDGET`] bytes.
struct HandshakeBudget<'a, S> {
    socket: &'a mut S,
    left: usize,
}

impl<S: Read> Read for HandshakeBudget<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the peer sent more than {} KiB before its TLS handshake completed",
                    HANDSHAKE_READ_BUDGET >> 10
                ),
            ));
        }
        let limit = buf.len().min(self.left);
        let read = self.socket.read(&mut buf[..limit])?;
        self.left -= read;
        Ok(read)
    }
}

impl<S: Write> Write for HandshakeBudget<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.socket.write(buf)
    }

    // rustls writes its queued records with one vectored write, and on a
    // failed handshake it makes only one last attempt to send its alert:
    // the default (first buffer only) would leave the alert unsent and the
    // peer would see a bare close instead of the reason.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.socket.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.socket.flush()
    }
}

/// The other end of a channel, as errors name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Peer {
    Source,
    Destination,
}

impl Peer {
    fn name(self) -> &'static str {
        match self {
            Self::Source => "source",
            Self::Destination => "destination",
        }
    }
}

/// Looks at the first byte a new connection sent, without taking it: a
/// tern source without TLS starts with a frame header, never with a TLS
/// record, and hears why it is refused in a frame it can read.
fn refuse_plaintext(socket: &socket2::Socket) -> Result<(), ChannelError> {
    let mut first = [std::mem::MaybeUninit::<u8>::uninit()];
    let peeked = socket.peek(&mut first).map_err(tls_error)?;
    if peeked == 0 {
        return Err(tls_error(io::ErrorKind::UnexpectedEof.into()));
    }
    // SAFETY: `peek` initialised the one byte it reported.
    let first = unsafe { first[0].assume_init() };
    let opens_a_session = [
        FrameKind::Hello,
        FrameKind::ChannelHello,
        FrameKind::AuthHello,
    ]
    .iter()
    .any(|&kind| kind as u8 == first);
    if !opens_a_session {
        // A TLS record (0x16 for a ClientHello), or bytes that are neither:
        // rustls says what is wrong.
        return Ok(());
    }
    let abort = Message::Abort(tern_wire::Abort {
        reason: tern_wire::AbortReason::ProtocolError,
        message: "this destination requires TLS: start the source with --tls-dir".into(),
    });
    let _ = (&*socket).write_all(&abort.to_bytes());
    Err(ChannelError::Tls(io::Error::new(
        io::ErrorKind::InvalidData,
        "the source does not speak TLS (it sent a plaintext tern frame): start it with --tls-dir",
    )))
}

fn handshake(
    channel: Channel,
    mut connection: Connection,
    kernel: KernelTls,
    peer: Peer,
) -> Result<Channel, ChannelError> {
    let security = channel.security.clone();
    let mut socket = channel.into_socket()?;
    let failed = |error: io::Error| match explain(&error, peer) {
        Some(text) => ChannelError::Tls(io::Error::new(error.kind(), text)),
        None => tls_error(error),
    };
    let mut budgeted = HandshakeBudget {
        socket: &mut socket,
        left: HANDSHAKE_READ_BUDGET,
    };
    while connection.is_handshaking() {
        connection.complete_io(&mut budgeted).map_err(failed)?;
    }
    // The last flight (the client's Finished) may still be queued.
    while connection.wants_write() {
        connection.write_tls(&mut socket).map_err(failed)?;
    }
    let info = TlsInfo {
        version: format!(
            "{:?}",
            connection
                .protocol_version()
                .unwrap_or(rustls::ProtocolVersion::TLSv1_3)
        ),
        cipher: connection
            .negotiated_cipher_suite()
            .map(|suite| format!("{:?}", suite.suite()))
            .unwrap_or_default(),
        kernel_offload: false,
    };
    let peer_identity = connection
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|leaf| leaf.as_ref().to_vec());
    let buffered = connection
        .process_new_packets()
        .map_err(|error| ChannelError::Tls(io::Error::other(error)))?
        .plaintext_bytes_to_read();
    let decision = offload_decision(kernel, &connection, buffered, || set_tls_ulp(&socket));
    let mut security = ChannelSecurity {
        tls: Some(info),
        peer_identity,
        ..security
    };
    let stream = match decision {
        Offload::Kernel => {
            let secrets = connection
                .dangerous_extract_secrets()
                .map_err(|error| ChannelError::Tls(io::Error::other(error)))?;
            install_kernel_keys(&socket, &secrets).map_err(ChannelError::Tls)?;
            if let Some(tls) = &mut security.tls {
                tls.kernel_offload = true;
            }
            Stream::Socket(socket)
        }
        Offload::UserSpace(reason) => {
            tracing::debug!("TLS records in user space: {reason}");
            Stream::Tls(Box::new(TlsStream {
                connection,
                socket,
                buffered,
                peer,
            }))
        }
    };
    let mut channel = Channel::new(stream)?;
    channel.security = security;
    Ok(channel)
}

/// A one-line reason for a TLS failure rustls reported inside `error`,
/// naming which side refused what; `None` when it is not rustls's.
fn explain(error: &io::Error, peer: Peer) -> Option<String> {
    use rustls::{AlertDescription as Alert, CertificateError as Certificate};
    let rustls_error = error.get_ref()?.downcast_ref::<rustls::Error>()?;
    let peer = peer.name();
    Some(match rustls_error {
        rustls::Error::AlertReceived(alert) => {
            let why = match alert {
                Alert::CertificateExpired => "this side's certificate has expired",
                Alert::CertificateRequired => {
                    "this side presented no certificate and it requires one"
                }
                Alert::UnknownCA => "it does not trust the CA that signed this side's certificate",
                Alert::BadCertificate => "it refused this side's certificate",
                Alert::CertificateRevoked => "this side's certificate is revoked",
                _ => "",
            };
            let why = if why.is_empty() {
                String::new()
            } else {
                format!(": {why}")
            };
            format!("the {peer} refused the TLS session (alert {alert:?}){why}")
        }
        rustls::Error::NoCertificatesPresented => {
            format!("the {peer} presented no certificate (mutual TLS requires one)")
        }
        rustls::Error::InvalidCertificate(Certificate::UnknownIssuer) => format!(
            "the {peer}'s certificate is not signed by a CA in this side's ca.pem (UnknownIssuer)"
        ),
        rustls::Error::InvalidCertificate(_) => {
            format!("the {peer}'s certificate is refused: {rustls_error}")
        }
        rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType) => format!(
            "the {peer} does not speak TLS (its bytes are not TLS records): is it started \
             without --tls-dir?"
        ),
        other => format!("the session with the {peer}: {other}"),
    })
}

fn tls_error(error: io::Error) -> ChannelError {
    match error.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            ChannelError::Timeout("the TLS handshake")
        }
        io::ErrorKind::UnexpectedEof => ChannelError::Tls(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed the connection during the TLS handshake (is it speaking TLS?)",
        )),
        _ => ChannelError::Tls(error),
    }
}

/// Where a channel's records are handled.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Offload {
    /// By the kernel: the socket reads and writes plaintext.
    Kernel,
    /// By rustls, for this reason.
    UserSpace(&'static str),
}

/// Decides where the records go. `set_ulp` attaches the kernel's `tls`
/// upper-layer protocol and is tried last, since a socket with the ULP
/// attached but no keys still passes bytes through unchanged.
pub(crate) fn offload_decision(
    kernel: KernelTls,
    connection: &Connection,
    buffered: usize,
    set_ulp: impl FnOnce() -> io::Result<()>,
) -> Offload {
    if kernel == KernelTls::Off {
        return Offload::UserSpace("kernel TLS turned off");
    }
    let aes_gcm = matches!(
        connection
            .negotiated_cipher_suite()
            .map(|suite| suite.suite()),
        Some(
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS13_AES_256_GCM_SHA384
        )
    );
    decide(aes_gcm, buffered, set_ulp)
}

fn decide(aes_gcm: bool, buffered: usize, set_ulp: impl FnOnce() -> io::Result<()>) -> Offload {
    if !aes_gcm {
        return Offload::UserSpace("the cipher is not AES-GCM");
    }
    if buffered > 0 {
        return Offload::UserSpace("rustls already holds received records");
    }
    match set_ulp() {
        Ok(()) => Offload::Kernel,
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => {
            Offload::UserSpace("the kernel has no tls ULP (module tls not loaded)")
        }
        Err(_) => Offload::UserSpace("the kernel refused the tls ULP"),
    }
}

fn set_tls_ulp(socket: &socket2::Socket) -> io::Result<()> {
    let name = b"tls";
    // SAFETY: `name` is valid for its length during the call.
    let result = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_ULP,
            name.as_ptr().cast(),
            crate::numeric::socklen_of_val(name),
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

// The kernel's interface (include/uapi/linux/tls.h), which the libc crate
// does not carry.
const TLS_TX: libc::c_int = 1;
const TLS_RX: libc::c_int = 2;
const TLS_1_3_VERSION: u16 = 0x0304;
const TLS_CIPHER_AES_GCM_128: u16 = 51;
const TLS_CIPHER_AES_GCM_256: u16 = 52;

/// `struct tls12_crypto_info_aes_gcm_128` / `_256`: the header, then the
/// explicit IV (the last 8 bytes of TLS 1.3's 12-byte IV), the key, the
/// salt (its first 4 bytes) and the record sequence number, big-endian.
#[repr(C)]
struct CryptoInfo<const KEY: usize> {
    version: u16,
    cipher_type: u16,
    iv: [u8; 8],
    key: [u8; KEY],
    salt: [u8; 4],
    rec_seq: [u8; 8],
}

impl<const KEY: usize> CryptoInfo<KEY> {
    fn new(cipher_type: u16, key: &[u8], iv: &[u8], sequence: u64) -> io::Result<Self> {
        let mut info = Self {
            version: TLS_1_3_VERSION,
            cipher_type,
            iv: [0; 8],
            key: [0; KEY],
            salt: [0; 4],
            rec_seq: sequence.to_be_bytes(),
        };
        if key.len() != KEY || iv.len() != 12 {
            return Err(io::Error::other("unexpected AES-GCM key or IV length"));
        }
        info.key.copy_from_slice(key);
        info.salt.copy_from_slice(&iv[..4]);
        info.iv.copy_from_slice(&iv[4..]);
        Ok(info)
    }

    fn install(&self, socket: &socket2::Socket, direction: libc::c_int) -> io::Result<()> {
        // SAFETY: `self` is a plain repr(C) struct valid for its size
        // during the call; the kernel copies it.
        let result = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_TLS,
                direction,
                (self as *const Self).cast(),
                crate::numeric::socklen_of::<Self>(),
            )
        };
        if result == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

fn install_kernel_keys(
    socket: &socket2::Socket,
    secrets: &rustls::ExtractedSecrets,
) -> io::Result<()> {
    for (direction, (sequence, secret)) in [(TLS_TX, &secrets.tx), (TLS_RX, &secrets.rx)] {
        match secret {
            rustls::ConnectionTrafficSecrets::Aes128Gcm { key, iv } => {
                CryptoInfo::<16>::new(TLS_CIPHER_AES_GCM_128, key.as_ref(), iv.as_ref(), *sequence)?
                    .install(socket, direction)?
            }
            rustls::ConnectionTrafficSecrets::Aes256Gcm { key, iv } => {
                CryptoInfo::<32>::new(TLS_CIPHER_AES_GCM_256, key.as_ref(), iv.as_ref(), *sequence)?
                    .install(socket, direction)?
            }
            _ => return Err(io::Error::other("kernel TLS takes AES-GCM only")),
        }
    }
    Ok(())
}

/// A channel whose records rustls encrypts and decrypts.
pub(crate) struct TlsStream {
    connection: Connection,
    socket: socket2::Socket,
    /// Decrypted bytes rustls holds that no read has taken yet.
    buffered: usize,
    /// Who is at the other end, for errors.
    peer: Peer,
}

impl fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsStream")
            .field("fd", &self.socket.as_raw_fd())
            .field("buffered", &self.buffered)
            .finish_non_exhaustive()
    }
}

impl TlsStream {
    pub(super) fn raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    pub(super) fn has_buffered_plaintext(&self) -> bool {
        self.buffered > 0
    }

    /// The channel error for a failed read or write: rustls's own failures
    /// (an alert, a bad record) are TLS errors that say who refused what.
    pub(super) fn channel_error(&self, error: io::Error) -> ChannelError {
        match explain(&error, self.peer) {
            Some(text) => ChannelError::Tls(io::Error::new(error.kind(), text)),
            None => super::map_io(error),
        }
    }

    /// Sends every queued record; each system call is one of `clock`'s
    /// transfer.
    fn flush(&mut self, clock: &mut TransferClock) -> Result<(), ChannelError> {
        while self.connection.wants_write() {
            clock.before_call()?;
            match self.connection.write_tls(&mut self.socket) {
                Ok(_) => {}
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(clock.failed(error)),
            }
        }
        Ok(())
    }

    /// Encrypts and sends the segments (one copy, into rustls's records),
    /// all of it within one transfer deadline of `timeout`, as on a plain
    /// socket.
    ///
    /// # Safety
    /// As [`Channel::send_vectored`].
    pub(super) unsafe fn send_segments(
        &mut self,
        segments: &[Segment],
        timeout: Option<Duration>,
    ) -> Result<(), ChannelError> {
        let mut clock = TransferClock::new(self.raw_fd(), libc::SO_SNDTIMEO, timeout);
        for segment in segments.iter().filter(|segment| segment.len > 0) {
            // SAFETY: the segment points to `len` readable bytes (caller's
            // contract); concurrent guest writes make the copy a mix of old
            // and new bytes, which the dirty log makes harmless.
            let bytes = unsafe { std::slice::from_raw_parts(segment.ptr, segment.len) };
            let mut rest = bytes;
            while !rest.is_empty() {
                let taken = self
                    .connection
                    .writer()
                    .write(rest)
                    .map_err(|error| self.channel_error(error))?;
                rest = &rest[taken..];
                if taken == 0 || self.connection.wants_write() {
                    self.flush(&mut clock)?;
                }
            }
        }
        self.flush(&mut clock)
    }

    fn read_exact(
        &mut self,
        buf: &mut [u8],
        clock: &mut TransferClock,
    ) -> Result<(), ChannelError> {
        let mut filled = 0;
        while filled < buf.len() {
            match self.connection.reader().read(&mut buf[filled..]) {
                Ok(0) => return Err(ChannelError::Closed),
                Ok(read) => {
                    filled += read;
                    self.buffered = self.buffered.saturating_sub(read);
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => self.fill(clock)?,
                Err(error) => return Err(self.channel_error(error)),
            }
        }
        Ok(())
    }

    /// Decrypts into the segments (one copy, out of rustls's buffer), all
    /// of it within `clock`'s transfer deadline, as on a plain
    /// socket: records trickling in do not restart the clock.
    ///
    /// # Safety
    /// As [`Channel::read_scattered`].
    pub(super) unsafe fn read_segments(
        &mut self,
        segments: &[Segment],
        mut clock: TransferClock,
    ) -> Result<(), ChannelError> {
        for segment in segments.iter().filter(|segment| segment.len > 0) {
            // SAFETY: the segment points to `len` writable, bounds-checked
            // bytes that nothing else accesses during the call (caller's
            // contract).
            let buf =
                unsafe { std::slice::from_raw_parts_mut(segment.ptr.cast_mut(), segment.len) };
            self.read_exact(buf, &mut clock)?;
        }
        Ok(())
    }

    /// Reads records from the socket (one system call of `clock`'s
    /// transfer) and decrypts them.
    fn fill(&mut self, clock: &mut TransferClock) -> Result<(), ChannelError> {
        clock.before_call()?;
        match self.connection.read_tls(&mut self.socket) {
            Ok(0) => return Err(ChannelError::Closed),
            Ok(_) => {}
            Err(error) if error.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(error) => return Err(clock.failed(error)),
        }
        let state = self.connection.process_new_packets().map_err(|error| {
            self.channel_error(io::Error::new(io::ErrorKind::InvalidData, error))
        })?;
        self.buffered = state.plaintext_bytes_to_read();
        if state.tls_bytes_to_write() > 0 {
            // An alert or a key update answer: a transfer of its own.
            let mut send = TransferClock::new(self.raw_fd(), libc::SO_SNDTIMEO, clock.timeout);
            self.flush(&mut send)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(errno: i32) -> impl FnOnce() -> io::Result<()> {
        move || Err(io::Error::from_raw_os_error(errno))
    }

    #[test]
    fn falls_back_to_user_space_where_the_kernel_has_no_tls() {
        assert_eq!(
            decide(true, 0, refused(libc::ENOENT)),
            Offload::UserSpace("the kernel has no tls ULP (module tls not loaded)")
        );
        assert!(matches!(
            decide(true, 0, refused(libc::EEXIST)),
            Offload::UserSpace(_)
        ));
        assert!(matches!(decide(false, 0, || Ok(())), Offload::UserSpace(_)));
        assert!(matches!(decide(true, 5, || Ok(())), Offload::UserSpace(_)));
        assert_eq!(decide(true, 0, || Ok(())), Offload::Kernel);
    }

    #[test]
    fn crypto_info_matches_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<CryptoInfo<16>>(), 40);
        assert_eq!(std::mem::size_of::<CryptoInfo<32>>(), 56);
        let iv: Vec<u8> = (0..12).collect();
        let info = CryptoInfo::<16>::new(TLS_CIPHER_AES_GCM_128, &[7; 16], &iv, 0x0102).unwrap();
        assert_eq!(info.salt, [0, 1, 2, 3]);
        assert_eq!(info.iv, [4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(info.rec_seq, [0, 0, 0, 0, 0, 0, 1, 2]);
        assert!(CryptoInfo::<32>::new(TLS_CIPHER_AES_GCM_256, &[7; 16], &iv, 0).is_err());
    }
}
