//! Dirty bitmaps: one bit per page, in 64-bit words (the layout KVM's dirty
//! log uses, so a VMM can OR its words straight in).

/// A bitmap with one bit per page of a region.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirtyBitmap {
    words: Vec<u64>,
    pages: u64,
}

impl DirtyBitmap {
    /// An empty (all clean) bitmap for `pages` pages.
    pub fn new(pages: u64) -> Self {
        let words = usize::try_from(pages.div_ceil(64)).expect("bitmap fits in memory");
        Self {
            words: vec![0; words],
            pages,
        }
    }

    /// Number of pages the bitmap covers.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Marks every page dirty.
    pub fn set_all(&mut self) {
        self.words.fill(u64::MAX);
        self.trim_tail();
    }

    /// Marks every page clean.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Marks page `page` dirty. Out-of-range pages are ignored.
    pub fn set(&mut self, page: u64) {
        if page < self.pages {
            self.words[(page / 64) as usize] |= 1 << (page % 64);
        }
    }

    /// Whether page `page` is dirty.
    pub fn get(&self, page: u64) -> bool {
        page < self.pages && self.words[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    /// Number of dirty pages.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The words, for a dirty-log implementation to OR into. Bits past
    /// [`DirtyBitmap::pages`] in the last word are ignored by readers.
    pub fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words
    }

    /// The words.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// ORs `other` into `self`.
    pub fn merge(&mut self, other: &DirtyBitmap) {
        for (mine, theirs) in self.words.iter_mut().zip(&other.words) {
            *mine |= theirs;
        }
        self.trim_tail();
    }

    /// Iterates over the dirty page indices in increasing order.
    pub fn iter_dirty(&self) -> impl Iterator<Item = u64> + '_ {
        let pages = self.pages;
        self.words
            .iter()
            .enumerate()
            .flat_map(|(index, &word)| BitIter {
                word,
                base: index as u64 * 64,
            })
            .take_while(move |&page| page < pages)
    }

    fn trim_tail(&mut self) {
        let tail_bits = self.pages % 64;
        if tail_bits != 0
            && let Some(last) = self.words.last_mut()
        {
            *last &= (1u64 << tail_bits) - 1;
        }
    }
}

struct BitIter {
    word: u64,
    base: u64,
}

impl Iterator for BitIter {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if self.word == 0 {
            return None;
        }
        let bit = self.word.trailing_zeros();
        self.word &= self.word - 1;
        Some(self.base + u64::from(bit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_all_respects_length() {
        let mut bitmap = DirtyBitmap::new(70);
        bitmap.set_all();
        assert_eq!(bitmap.count(), 70);
        assert_eq!(bitmap.iter_dirty().last(), Some(69));
    }

    #[test]
    fn iterates_set_bits_in_order() {
        let mut bitmap = DirtyBitmap::new(200);
        for page in [0, 5, 63, 64, 130, 199, 500] {
            bitmap.set(page);
        }
        let pages: Vec<u64> = bitmap.iter_dirty().collect();
        assert_eq!(pages, vec![0, 5, 63, 64, 130, 199]);
        assert!(bitmap.get(130));
        assert!(!bitmap.get(131));
    }

    #[test]
    fn merge_ors_bits() {
        let mut a = DirtyBitmap::new(10);
        let mut b = DirtyBitmap::new(10);
        a.set(1);
        b.set(2);
        a.merge(&b);
        assert_eq!(a.iter_dirty().collect::<Vec<_>>(), vec![1, 2]);
        a.clear();
        assert_eq!(a.count(), 0);
    }
}
