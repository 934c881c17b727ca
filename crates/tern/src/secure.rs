//! The security options of the commands: `--auth-key`, `--tls-dir`,
//! `--tls-hostname` on both sides, `--insecure` and `--allow-unverified` on
//! the destination, and the throwaway CA of `tern demo --tls`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tern_engine::{AuthKey, Listener, Security, TlsConfig, UnauthenticatedPolicy};

use crate::args::security::{DestinationSecurityArgs, SourceSecurityArgs};

impl SourceSecurityArgs {
    /// The engine's settings from these options.
    pub(crate) fn security(&self) -> anyhow::Result<Security> {
        let mut security = load(self.auth_key.as_ref(), self.tls_dir.as_ref())?;
        if let (Some(tls), Some(name)) = (&mut security.tls, &self.tls_hostname) {
            Arc::make_mut(tls).hostname = Some(name.clone());
        }
        Ok(security)
    }
}

impl DestinationSecurityArgs {
    /// The policy check on the address alone, before it is bound: an
    /// address other machines reach is refused without --auth-key,
    /// --tls-dir or --insecure (the check on the bound listener, in
    /// [`Self::apply`], stays for the addresses only binding resolves).
    pub(crate) fn check_before_bind(&self, address: &tern_engine::Address) -> anyhow::Result<()> {
        if self.insecure || self.auth_key.is_some() || self.tls_dir.is_some() {
            return Ok(());
        }
        if address.is_local_only() == Some(false) {
            anyhow::bail!(
                "refusing to receive unauthenticated migrations on {address}, which other \
                 machines can reach: give --auth-key FILE or --tls-dir DIR (or --insecure on a \
                 network you trust)"
            );
        }
        Ok(())
    }

    /// The engine's settings, after the policy check on `listener`: refused
    /// unauthenticated where other machines reach it (unless --insecure),
    /// warned about on loopback.
    pub(crate) fn apply(
        &self,
        listener: &Listener,
        config: &mut tern_engine::ReceiveConfig,
    ) -> anyhow::Result<()> {
        config.security = load(self.auth_key.as_ref(), self.tls_dir.as_ref())?;
        config.allow_unverified = self.allow_unverified;
        config.unauthenticated = if self.insecure {
            UnauthenticatedPolicy::Allow
        } else {
            UnauthenticatedPolicy::LocalOnly
        };
        if config.security.authenticates() {
            return Ok(());
        }
        let address = listener.local_address()?;
        if self.insecure || listener.is_local_only() {
            eprintln!(
                "tern: warning: {address} accepts unauthenticated migrations: anyone who can \
                 connect to it can send a guest; use --auth-key or --tls-dir"
            );
            return Ok(());
        }
        anyhow::bail!(
            "refusing to receive unauthenticated migrations on {address}, which other machines \
             can reach: give --auth-key FILE or --tls-dir DIR (or --insecure on a network you \
             trust)"
        )
    }
}

fn load(auth_key: Option<&PathBuf>, tls_dir: Option<&PathBuf>) -> anyhow::Result<Security> {
    let auth_key = auth_key
        .map(|path| {
            warn_if_readable_by_others(path);
            AuthKey::load(path)
                .map(Arc::new)
                .with_context(|| format!("--auth-key {}", path.display()))
        })
        .transpose()?;
    let tls = tls_dir
        .map(|dir| {
            TlsConfig::from_dir(dir)
                .map(Arc::new)
                .with_context(|| format!("--tls-dir {}", dir.display()))
        })
        .transpose()?;
    Ok({
        let mut config = Security::default();
        config.tls = tls;
        config.auth_key = auth_key;
        config
    })
}

fn warn_if_readable_by_others(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(metadata) = std::fs::metadata(path)
        && metadata.permissions().mode() & 0o077 != 0
    {
        eprintln!(
            "tern: warning: {} can be read by other users; `chmod 600` it",
            path.display()
        );
    }
}

/// Both ends of a demo over TLS: a CA made for this run only (rcgen), a
/// destination certificate for 127.0.0.1 and localhost, a source
/// certificate; nothing is written to disk.
pub(crate) fn throwaway_tls() -> anyhow::Result<(Security, Security)> {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "tern demo CA (throwaway)");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate()?)?;
    let identity = |names: &[&str]| -> anyhow::Result<Arc<TlsConfig>> {
        let names: Vec<String> = names.iter().map(ToString::to_string).collect();
        let key = rcgen::KeyPair::generate()?;
        let certificate = rcgen::CertificateParams::new(names)?.signed_by(&key, &ca)?;
        let config = TlsConfig::from_pem(
            ca.pem().as_bytes(),
            certificate.pem().as_bytes(),
            key.serialize_pem().as_bytes(),
        )?;
        Ok(Arc::new(config))
    };
    let source = {
        let mut config = Security::default();
        config.tls = Some(identity(&["tern-demo-source"])?);
        config.auth_key = None;
        config
    };
    let destination = {
        let mut config = Security::default();
        config.tls = Some(identity(&["127.0.0.1", "localhost"])?);
        config.auth_key = None;
        config
    };
    Ok((source, destination))
}
