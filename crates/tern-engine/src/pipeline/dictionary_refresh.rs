//! Refreshing the zstd dictionary at an iteration boundary, and why no
//! packet can reach the destination before the dictionary it names.
//!
//! The order, for a dictionary trained while iteration *i* is sent:
//! 1. all of *i*'s packets are sent (`sync_channels` waits for them), and
//!    they all name the dictionary in use, an older one;
//! 2. the new dictionary goes on the main channel;
//! 3. *i*'s sync on every page channel counts it;
//! 4. only once every channel's sender has written its sync do batches of
//!    *i+1* name it, and a channel's packets leave in order after its sync.
//!
//! The destination puts it in force at the barrier of *i*, which each
//! receiver reaches only once the main channel has delivered every
//! dictionary its sync counts; packets of *i+1* are read after the barrier.
//!
//! `auto`'s first dictionary, deferred from setup and trained in the
//! background once the link is measured, does not wait for a boundary
//! (protocol 13): it goes on the main channel as soon as it is trained,
//! and the batches made after that name it. A packet naming it may reach
//! the destination before the main channel's copy (two connections race);
//! its receiver waits for the copy, at most the I/O timeout. A paused
//! migration is one pass: at a boundary, the dictionary came into force
//! only for pages it had already sent (issue 31, item 4: the text pages
//! of the `runs` image went as 11.7 MB without it).

use tern_page::codec::DICTIONARY_SAMPLE_PAGES;
use tern_wire::{Dictionary, MAX_PAGES_PER_PACKET, Message, codec_id};

use super::batch::Batch;
use super::refresher::{
    DictionaryRefresher, HELD_OUT_RUNS, HeldOut, Judge, Refreshed, sample_dirty_pages,
};
use super::{DictionaryState, Pipeline, auto_codec};
use crate::bitmap::DirtyBitmap;
use crate::error::MigrationError;
use crate::transport::Channel;

impl DictionaryState {
    /// Adds a returned batch's dictionary-compressed data pages to the
    /// iteration's window.
    pub(super) fn count(&mut self, batch: &Batch) {
        if batch.dictionary == 0 || !batch.codec.is_zstd() {
            return;
        }
        for (_, counters) in batch.codec_stats.used() {
            if let Some(ran) = auto_codec::data_the_codec_ran_on(counters) {
                self.window.pages += ran.pages;
                self.window.bytes_in += ran.bytes_in;
                self.window.bytes_out += ran.bytes_out;
            }
        }
    }
}

impl Pipeline<'_> {
    /// At a live iteration's boundary, before its syncs: judges the
    /// dictionary on the iteration's window, and announces a refreshed one
    /// on `main` when one is ready (order: see the module's comment).
    pub(super) fn refresh_dictionary(
        &mut self,
        bitmaps: &[DirtyBitmap],
        main: &mut Channel,
    ) -> Result<(), MigrationError> {
        let window = std::mem::take(&mut self.dictionaries.window);
        let Some(refresher) = self.dictionaries.refresher.as_mut() else {
            return Ok(());
        };
        let regions = &self.shared.regions;
        let Some(refreshed) = refresher.at_boundary(&window, || {
            sample_dirty_pages(regions, bitmaps, DICTIONARY_SAMPLE_PAGES)
        }) else {
            return Ok(());
        };
        let Some(refreshed) = self.keep_first_if_it_pays(refreshed) else {
            return Ok(());
        };
        self.announce_dictionary(refreshed, main, "in force from the next iteration")
    }

    /// `refreshed`, unless it is `auto`'s first dictionary and the codec in
    /// force did not do better with it on the held-out pages: then it is
    /// dropped, with refreshing (there is no dictionary 1 to refresh), and
    /// the decision says why.
    fn keep_first_if_it_pays(&mut self, refreshed: Refreshed) -> Option<Refreshed> {
        // Only the first is judged (`start_first`): a refresh has none.
        let Some(held_out) = refreshed.held_out.filter(|held_out| !held_out.pays()) else {
            return Some(refreshed);
        };
        self.dictionaries.refresher = None;
        let reason = format!(
            "{}'s ratio on {} held-out pages was {:.4} with it against {:.4} without: below the \
             {:.0} % a dictionary must gain",
            self.codec.name(),
            held_out.pages,
            held_out.with,
            held_out.without,
            (HeldOut::GAIN - 1.0) * 100.0
        );
        self.note_auto("dictionary", "off".to_string(), reason);
        tracing::info!(?held_out, "the first dictionary does not pay: not used");
        None
    }

    /// In the middle of a pass, once `auto`'s first dictionary finished
    /// training: announces it on `main` and compresses the batches made
    /// from now on against it (order: see the module's comment).
    pub(super) fn announce_first_dictionary(
        &mut self,
        main: &mut Channel,
    ) -> Result<(), MigrationError> {
        let Some(refresher) = self.dictionaries.refresher.as_mut() else {
            return Ok(());
        };
        let Some(refreshed) = refresher.take_first_if_finished() else {
            return Ok(());
        };
        let Some(refreshed) = self.keep_first_if_it_pays(refreshed) else {
            return Ok(());
        };
        self.announce_dictionary(refreshed, main, "in use from the next batch")?;
        self.dictionaries.in_use = self.dictionaries.announced;
        Ok(())
    }

    /// Sends `refreshed` on `main` and records it; `when` says when it
    /// comes into use, for auto's decision log.
    fn announce_dictionary(
        &mut self,
        refreshed: Refreshed,
        main: &mut Channel,
        when: &str,
    ) -> Result<(), MigrationError> {
        let dictionary = refreshed.dictionary;
        main.send_message(&Message::Dictionary(Dictionary {
            id: dictionary.id(),
            codec: codec_id::ZSTD,
            data: dictionary.bytes().to_vec(),
        }))
        .map_err(MigrationError::channel(0))?;
        self.dictionaries.announced = dictionary.id();
        if dictionary.id() == 1 {
            // auto's first dictionary, deferred from setup: not a refresh.
            self.dictionaries.deferred = Some(crate::stats::DictionaryReport {
                bytes: dictionary.bytes().len() as u64,
                sample_pages: DICTIONARY_SAMPLE_PAGES as u64,
                training_ms: refreshed.training_ms,
                trained: 1,
                ..crate::stats::DictionaryReport::default()
            });
            let judged = refreshed.held_out.map_or(String::new(), |held_out| {
                format!(
                    "; ratio on {} held-out pages {:.4} with it against {:.4} without",
                    held_out.pages, held_out.with, held_out.without
                )
            });
            self.note_auto(
                "dictionary",
                dictionary.bytes().len().to_string(),
                format!(
                    "trained in the background in {:.0} ms{judged}: {when}",
                    refreshed.training_ms
                ),
            );
        } else {
            self.dictionaries.refreshes += 1;
            self.dictionaries.refresh_training_ms += refreshed.training_ms;
        }
        self.shared
            .dictionaries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(dictionary);
        Ok(())
    }

    /// The dictionary report with the refreshes so far.
    pub(super) fn dictionary_report(&self) -> Option<crate::stats::DictionaryReport> {
        let mut report = self
            .shared
            .compression
            .dictionary_report
            .clone()
            .or_else(|| self.dictionaries.deferred.clone())?;
        report.refreshes = self.dictionaries.refreshes;
        report.trained += self.dictionaries.refreshes;
        report.refresh_training_ms = self.dictionaries.refresh_training_ms;
        Some(report)
    }
}

impl Pipeline<'_> {
    /// With `auto` and the first dictionary deferred from setup: once the
    /// decision on the measured link (`link`, bytes per second) is a zstd
    /// codec, starts training it on pages sampled across guest memory, on
    /// a background thread, where it is then judged on held-out runs of
    /// pages with the codec and level in force; it comes into use as soon
    /// as it is trained, if it pays (`keep_first_if_it_pays`). On a link
    /// faster than the codecs (raw) it is never trained, and setup no
    /// longer pays for it (issue 31: 164-315 ms of a loopback migration's
    /// setup).
    pub(super) fn start_deferred_dictionary(&mut self, link: f64) {
        if self.codec.is_stream() {
            self.forgo_deferred_dictionary(link);
            return;
        }
        if !self.codec.is_zstd() {
            return;
        }
        let (codec, level) = (self.codec, self.batch_level());
        let Some(refresher) = self.dictionaries.refresher.as_mut() else {
            return;
        };
        if !refresher.first_pending() {
            return;
        }
        let regions = &self.shared.regions;
        let started = refresher.start_first(
            || auto_codec::sample_pages(regions, DICTIONARY_SAMPLE_PAGES),
            || Judge {
                pages: auto_codec::sample_runs(regions, HELD_OUT_RUNS, MAX_PAGES_PER_PACKET),
                codec,
                level,
            },
        );
        if started {
            let reason = format!(
                "{} on the measured {:.0} MB/s link: training a dictionary on {} sampled pages \
                 in the background",
                codec.name(),
                link / 1e6,
                DICTIONARY_SAMPLE_PAGES
            );
            self.note_auto("dictionary", "training".to_string(), reason);
        }
    }

    /// A channel stream on the measured link: its window holds what the
    /// channel sent (2 MiB of it), which a 64 KiB dictionary would add to
    /// only in a stream's first packets, so the first dictionary is not
    /// trained.
    fn forgo_deferred_dictionary(&mut self, link: f64) {
        let forgone = self
            .dictionaries
            .refresher
            .as_mut()
            .is_some_and(DictionaryRefresher::forgo_first);
        if forgone {
            let reason = format!(
                "{} on the measured {:.0} MB/s link: each channel's stream reaches back over \
                 what the channel sent, where a dictionary would help only its first packets",
                self.codec.name(),
                link / 1e6,
            );
            self.note_auto("dictionary", "off".to_string(), reason);
        }
    }
}
